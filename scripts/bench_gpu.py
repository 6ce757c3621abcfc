"""GPU benchmark of a real architecture with random weights (no download); prints JSON.

    python scripts/bench_gpu.py                                   # SD3.5-Medium, 512 px, bf16, cuda
    python scripts/bench_gpu.py --arch sd3.5-large --resolution 1024 --batch 4
    python scripts/bench_gpu.py --tiny --device cpu --dtype float32   # checks the script on the tiny SD3

The transformer is built from its published config (omni/models/configs/, or --tiny: the
tiny SD3's) with random weights, a LoRA on the family's default targets, and the family's VAE;
the text conditioning is random tensors of the real shapes (the text encoders are not what
is measured). One run measures, on the same transformer, VAE, batch, steps, CFG and size:

- rollout: images/s of our sampler (every step an SDE step with its log-prob, the trajectory
  kept, decoded) against the diffusers pipeline's own `__call__`, and their ratio;
- update: training transitions/s of one micro-batch forward + backward through the LoRA with
  CFG (what Flow-GRPO's update computes per transition), with and without checkpointing;
- peak device memory of each phase, model FLOPs utilisation (2 x linear params x tokens
  per forward plus attention, backward counted as one more forward for a frozen base),
  and the seconds `collect_lora_params` takes to gather the LoRA for an engine copy
  (with the default shared engine no sync runs at all).
Best of --repeats timings after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources

import torch

from omni.config.model import LoraConfig
from omni.fsdp_utils import collect_lora_params
from omni.models import get_family
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_trajectories
from omni.weights import add_lora_adapter

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def config_json(name: str) -> dict:
    return json.loads((resources.files("omni") / "models" / "configs" / name).read_text())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def peak_gib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def build_pipeline(args, device: torch.device, dtype: torch.dtype):
    """The SD3 pipeline around a random real-architecture transformer (LoRA attached) and VAE."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    if args.tiny:
        family = get_family("sd3")
        root = family.tiny_path(args.cache_dir, 0)
        transformer_config = family.transformer_config(root)
        vae_config = AutoencoderKL.load_config(str(root), subfolder="vae")
    else:
        transformer_config = config_json(f"{args.arch}-transformer.json")
        vae_config = config_json("sd3.5-vae.json")
    torch.manual_seed(0)
    with torch.device(device):
        transformer = SD3Transformer2DModel.from_config(transformer_config).to(dtype)
        vae = AutoencoderKL.from_config(vae_config).float()
    transformer.requires_grad_(False)
    add_lora_adapter(transformer, LoraConfig(rank=args.lora_rank, alpha=args.lora_rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    none = dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"])
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, **none)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def random_conditioning(pipe, batch: int, text_tokens: int, device: torch.device, dtype: torch.dtype):
    """SD3's conditioning (77 CLIP + `text_tokens` T5 tokens, pooled CLIP), with negatives."""
    config = pipe.transformer.config
    generator = torch.Generator().manual_seed(1)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    cls = get_family("sd3").conditioning
    return cls(
        draw(batch, 77 + text_tokens, config.joint_attention_dim),
        draw(batch, config.pooled_projection_dim),
        draw(batch, 77 + text_tokens, config.joint_attention_dim),
        draw(batch, config.pooled_projection_dim),
    )


def forward_flops(transformer, tokens: int, batch: int) -> float:
    """Matmul FLOPs of one forward of `batch` sequences of `tokens` tokens."""
    linear = sum(m.weight.numel() for m in transformer.modules() if isinstance(m, torch.nn.Linear))
    config = transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    return batch * (2 * linear * tokens + 4 * config.num_layers * tokens**2 * hidden)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd3.5-medium", choices=["sd3.5-medium", "sd3.5-large"])
    parser.add_argument("--tiny", action="store_true", help="the tiny SD3 instead (checks the script)")
    parser.add_argument("--cache-dir", default="~/.cache/omni-recipes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="images per rollout call")
    parser.add_argument("--micro-batch", type=int, default=4, help="transitions per update forward/backward")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--text-tokens", type=int, default=256, help="T5 tokens (model.max_sequence_length)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100/H200: 989)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.tiny:
        args.text_tokens = min(args.text_tokens, 16)

    family = get_family("sd3")
    pipe = build_pipeline(args, device, dtype)
    transformer = pipe.transformer
    cfg = args.guidance > 1
    cond = random_conditioning(pipe, args.batch, args.text_tokens, device, dtype)
    options = SamplingOptions(args.steps, args.resolution, args.guidance, 0.7, args.text_tokens, sde_steps=(0, args.steps))
    sigmas = family.sigmas(pipe, args.steps, args.resolution)
    seeds = list(range(args.batch))

    @torch.no_grad()
    def ours():
        sample_trajectories(family, pipe, cond, seeds, sigmas, options, device, dtype)

    @torch.no_grad()
    def plain():
        generators = [torch.Generator(device).manual_seed(s) for s in seeds]
        negatives = dict(negative_prompt_embeds=cond.neg_embeds, negative_pooled_prompt_embeds=cond.neg_pooled) if cfg else {}
        pipe(prompt_embeds=cond.embeds, pooled_prompt_embeds=cond.pooled, **negatives, num_inference_steps=args.steps,
             guidance_scale=args.guidance, height=args.resolution, width=args.resolution, generator=generators,
             output_type="pt")  # fmt: skip

    ours_s, plain_s = best_time(ours, device, args.repeats), best_time(plain, device, args.repeats)
    rollout_peak = peak_gib(ours, device)

    latent = family.initial_latents(pipe, [torch.Generator().manual_seed(s) for s in range(args.micro_batch)], args.resolution)
    latent = latent.to(device, dtype)
    sigma = torch.full((args.micro_batch,), 0.5, device=device)
    micro_cond = cond.apply(lambda t: t[: args.micro_batch])

    def update():
        velocity = family.predict_velocity(transformer, latent, sigma, micro_cond, args.guidance)
        velocity.square().mean().backward()

    update_s, update_peak = {}, {}
    for checkpointing in (False, True):
        transformer.enable_gradient_checkpointing() if checkpointing else transformer.disable_gradient_checkpointing()
        transformer.train(checkpointing)  # diffusers checkpoints only in training mode
        key = "checkpointing" if checkpointing else "plain"
        update_s[key] = best_time(update, device, args.repeats)
        update_peak[key] = peak_gib(update, device)
    transformer.eval()

    sync_s = best_time(lambda: collect_lora_params(transformer, False, True, True, "default", family.layer_prefixes), device, args.repeats)

    image_tokens = (args.resolution // pipe.vae_scale_factor // transformer.config.patch_size) ** 2
    tokens = image_tokens + 77 + args.text_tokens
    width = 2 if cfg else 1
    rollout_flops = args.steps * forward_flops(transformer, tokens, args.batch * width)
    update_flops = 2 * forward_flops(transformer, tokens, args.micro_batch * width)
    peak = args.peak_tflops * 1e12
    report = {
        "settings": {"arch": "tiny-sd3" if args.tiny else args.arch, "device": str(device), "dtype": args.dtype,
                     "resolution": args.resolution, "batch": args.batch, "micro_batch": args.micro_batch,
                     "steps": args.steps, "guidance": args.guidance, "text_tokens": 77 + args.text_tokens,
                     "lora_rank": args.lora_rank, "params": sum(p.numel() for p in transformer.parameters())},  # fmt: skip
        "rollout": {
            "ours_images_per_s": round(args.batch / ours_s, 3),
            "diffusers_images_per_s": round(args.batch / plain_s, 3),
            "ours_over_diffusers": round(plain_s / ours_s, 3),
            "peak_gib": rollout_peak,
            "mfu": round(rollout_flops / ours_s / peak, 4),
        },
        "update": {
            "transitions_per_s": {k: round(args.micro_batch / s, 3) for k, s in update_s.items()},
            "peak_gib": update_peak,
            "mfu": {k: round(update_flops * (1.5 if k == "checkpointing" else 1) / s / peak, 4) for k, s in update_s.items()},
        },
        "lora_collect_seconds": round(sync_s, 4),
    }
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
