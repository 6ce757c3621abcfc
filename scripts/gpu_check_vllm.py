"""Check rollout=vllm on a GPU machine: the real vLLM-Omni engine, with each backend
(`vllm`: our diffusers pipeline inside vLLM-Omni; `native`: vLLM-Omni's own SD3 pipeline with
our SDE scheduler), against our in-process diffusers engine (rollout=diffusers), on an
SD3.5-Medium-sized transformer with random weights. Prints one JSON object: images/s of
each, sync seconds, the largest log-prob difference of each backend, and the importance
ratios the first update would start from (the actor re-scoring the engine's samples: mean
and largest |ratio - 1|; 0 for an exact engine, in bf16 the kernels' rounding).

    bash scripts/install_vllm_engine.sh                   # once: the engine's own env
    python scripts/gpu_check_vllm.py [--size sd35m|tiny] [--images 32] [--backends vllm,native]
                                     [--python ENV/bin/python]
    python scripts/gpu_check_vllm.py --device cpu --size tiny --images 4 --resolution 64   # a dry run

The checkpoint is the tiny SD3 (tiny text encoders and VAE, no download) with its
transformer replaced by one of SD3.5-Medium's shape (24 MMDiT blocks, 1536 wide, dual
attention in the first 13), so the timings are the transformer's. The engine starts
without base weights: the first sync sends the whole transformer (`sync_base_s`), then a
rank-32 LoRA (`sync_lora_s`), the syncs a training run makes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from omni.config.model import LoraConfig
from omni.models.sd3 import FAMILY, build_tiny_sd3_pipeline, build_tiny_transformer
from omni.rollout.base import SamplingOptions
from omni.rollout.diffusers_engine import load_diffusers_engine
from omni.rollout.sampling import rescore_log_probs
from omni.rollout.vllm_engine import VllmEngine
from omni.rollout.vllm_options import VllmOptions
from omni.weights import add_lora_adapter, lora_tensors, plain_base_names

SD35_MEDIUM = dict(
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    caption_projection_dim=1536,
    qk_norm="rms_norm",
    dual_attention_layers=tuple(range(13)),
    sample_size=64,
    pos_embed_max_size=192,
)
LORA = LoraConfig(rank=32, alpha=64, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


def build_checkpoint(path: Path, size: str) -> Path:
    """The tiny pipeline, with an SD3.5-Medium-sized random transformer for size=sd35m."""
    pipe = build_tiny_sd3_pipeline(seed=0)
    if size == "sd35m":
        torch.manual_seed(0)
        pipe.transformer = build_tiny_transformer(0, **SD35_MEDIUM).to(torch.bfloat16)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def trained_weights(engine, seed: int = 0):
    """Base weights and a random LoRA in collect_lora_params' naming, on the CPU."""
    transformer = engine.transformer
    base = {k: v.detach().cpu() for k, v in plain_base_names(transformer).items()}
    add_lora_adapter(transformer, LORA)
    engine.adapter_name = LORA.adapter_name
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_tensors(transformer, LORA.adapter_name).values():
            p.copy_(torch.randn(p.shape, generator=generator).to(p) * 0.02)
    return base, {k: v.detach().cpu() for k, v in lora_tensors(transformer, LORA.adapter_name).items()}


def images_per_second(engine, prompts, seeds, options) -> float:
    engine.generate(prompts[:2], seeds[:2], options)  # warm-up
    start = time.perf_counter()
    engine.generate(prompts, seeds, options)
    return len(prompts) / (time.perf_counter() - start)


def first_update_ratio(local, batch) -> dict:
    """The importance ratios an update starts from: the actor (the in-process engine's
    transformer, PEFT LoRA) re-scoring the engine's own samples, over the SDE steps."""
    start, stop = batch.options.sde_steps
    rescored = rescore_log_probs(FAMILY, local.transformer, batch, local.dtype)
    ratio = torch.exp((rescored - batch.log_probs)[:, start:stop].double())
    return {
        "first_update_mean_abs_ratio_minus_1": float((ratio - 1).abs().mean()),
        "first_update_max_abs_ratio_minus_1": float((ratio - 1).abs().max()),
    }


def check_backend(backend, args, model, device, dtype, workdir, base, lora, local, prompts, seeds, options) -> dict:
    """Start an engine of `backend` without base weights, sync the base then the LoRA, time
    its rollouts and compare its log-probs with the in-process engine's."""
    engine_options = VllmOptions(python=args.python, backend=backend)
    engine = VllmEngine.start(
        FAMILY, engine_options, model, device, dtype, args.micro_batch, False, workdir / f"run-{backend}"
    )
    try:
        start = time.perf_counter()
        engine.update_weights(base, base_sync_done=False, lora=None)
        sync_base = time.perf_counter() - start
        start = time.perf_counter()
        engine.update_weights(lora, base_sync_done=True, lora=LORA)
        sync_lora = time.perf_counter() - start
        result = {
            "images_per_s": round(images_per_second(engine, prompts, seeds, options), 3),
            "sync_base_s": round(sync_base, 2),
            "sync_lora_s": round(sync_lora, 3),
        }
        # bf16 kernels differ with batch composition (and native's are vLLM-Omni's, its
        # LoRA in the model's dtype): expect small, not zero, differences
        a, b = engine.generate(prompts[:4], seeds[:4], options), local.generate(prompts[:4], seeds[:4], options)
        result["max_log_prob_diff"] = float((a.log_probs - b.log_probs).abs().max())
        result.update(first_update_ratio(local, a))
    finally:
        engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("sd35m", "tiny"), default="sd35m")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--backends", default="vllm,native", help="engine backends to check, in turn")
    parser.add_argument("--python", default=None, help="engine env python (default: as rollout=vllm finds it)")
    parser.add_argument("--workdir", default="/tmp/omni-gpu-check")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (with --size tiny)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), help="the transformer's (default: bfloat16 on cuda, else float32)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    workdir = Path(args.workdir)
    model = build_checkpoint(workdir / f"sd3-{args.size}", args.size)
    options = SamplingOptions(
        num_steps=10,
        resolution=args.resolution,
        guidance_scale=4.5,
        noise_level=0.7,
        max_sequence_length=256,
        sde_steps=(0, 10),
    )
    prompts = [f"a photo of a {c} cat" for c in ("red", "green", "blue", "white")] * (args.images // 4)
    seeds = list(range(len(prompts)))

    local = load_diffusers_engine(FAMILY, model, device, dtype, args.micro_batch, load_base=True)
    base, lora = trained_weights(local)
    report = {
        "size": args.size,
        "transformer_params_m": round(sum(t.numel() for t in base.values()) / 1e6, 1),
        "images": len(prompts),
        "resolution": args.resolution,
        "steps": options.num_steps,
        "diffusers_images_per_s": round(images_per_second(local, prompts, seeds, options), 3),
    }
    for backend in args.backends.split(","):  # one engine at a time: each holds its own copy
        report[backend] = check_backend(
            backend, args, model, device, dtype, workdir, base, lora, local, prompts, seeds, options
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
