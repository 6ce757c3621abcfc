"""GPU benchmark of the real SD3.5-Medium and FLUX.1-dev architectures with random weights
(no download); prints JSON, one section per architecture.

    python scripts/bench_gpu.py                      # SD3.5-Medium then FLUX.1-dev: 512 px, bf16, cuda
    python scripts/bench_gpu.py --arch flux.1-dev --resolution 1024 --batch 4
    python scripts/bench_gpu.py --estimate           # the FLOPs and seconds estimate only (meta device)
    python scripts/bench_gpu.py --tiny --device cpu --dtype float32   # checks the script on each family's tiny model

Each `--arch` (default: sd3.5-medium, then flux.1-dev; any published architecture of the SD3
and FLUX families) is built from its family's published configs (omni/models/configs/: the
transformer's, the family's VAE's `published_vae_config`, its `published_scheduler_config`;
with --tiny, the family's tiny model's) with random weights, a LoRA on the family's default
targets, the VAE in fp32 as the recipes keep it. The text conditioning is random tensors of
the real shapes (the text encoders are not what is measured): SD3, CLIP's 77 tokens then
T5's 256 (StableDiffusion3Pipeline's default max_sequence_length), width 4096, pooled 2048,
negatives for classifier-free guidance 4.5 (two passes); FLUX.1-dev, T5's 512 tokens
(FluxPipeline's default), width 4096, CLIP's pooled 768, distilled guidance 3.5 (one pass).
On the same transformer, VAE, batch, steps, guidance and size it measures:

- rollout: images/s of our sampler (every step an SDE step with its log-prob, the trajectory
  kept, decoded) against the family's diffusers pipeline `__call__` given the same
  embeddings (StableDiffusion3Pipeline / FluxPipeline; a pre-hook hands its VAE fp32 latents,
  as ours does), and their ratio;
- update: training transitions/s of one micro-batch forward + backward through the LoRA
  (what Flow-GRPO's update computes per transition), without and with gradient
  checkpointing, for each `algorithm.cfg_gradient` the family takes: SD3 `both` (the exact
  gradient through both CFG passes) and `conditional` (the unconditional pass without
  gradients); FLUX's one pass is `both` alone;
- peak device memory of each phase; model FLOPs utilisation of the transformer (`omni.flops`): per forward,
  the FLOPs torch's FlopCounterMode counts for one pass on the meta device (every matmul and
  attention of the real shapes, the LoRA's included); an update counts one more forward for
  its backward (the base is frozen: no weight gradients) and not the checkpointing's
  recompute; the VAE is not counted;
- the memory estimator (omni.memory, `scripts/estimate_memory.py`) against the measured peak
  of the update with every pass differentiated, without and with checkpointing (error in %);
- the bf16 noise floor of the importance ratios: one rollout re-scored by the actor one
  micro-batch at a time (`rescore_log_probs`), nothing trained in between;
- the seconds `collect_lora_params` takes to gather the LoRA for an engine copy (with the
  default shared engine no sync runs at all).
Times are the best of --repeats after one warm-up.

Time on one H200, an ESTIMATE from these FLOPs at 15% of 989 dense bf16 TFLOPS, with the
defaults (512 px, batch 8, 10 steps, micro-batch 4, 2 repeats; `--estimate` prints it): the
transformer's timed work is ~19 s for SD3.5-Medium (rollouts 16 s, updates 3 s) and ~78 s for
FLUX.1-dev (70 s, 9 s), to which come the VAE's decoding, building the models (random
initialisation on the GPU) and the imports: well inside 8 minutes.
`--time-budget-s` skips a phase whose estimate no longer fits in what is left of it, naming it
under the section's `skipped`.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
import time
import traceback
from importlib import resources
from types import SimpleNamespace

import torch

from omni.config.model import LoraConfig
from omni.devices import DTYPES, disable_cudnn_attention
from omni.flops import ARCH_SETTINGS, TINY_T5_TOKENS, cfg_gradients, flops_plan
from omni.fsdp_utils import collect_lora_params
from omni.memory import arch_config, count, estimate
from omni.models import get_family
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.sampling import rescore_log_probs, sample_trajectories
from omni.weights import add_lora_adapter, is_lora_name

FAMILIES = ("sd3", "flux")  # image families whose diffusers pipeline takes prompt embeddings
DEFAULT_ARCHS = ["sd3.5-medium", "flux.1-dev"]
# The pipelines' `__call__` argument for each conditioning field (both families name them alike).
PIPELINE_ARGS = {
    "embeds": "prompt_embeds",
    "pooled": "pooled_prompt_embeds",
    "neg_embeds": "negative_prompt_embeds",
    "neg_pooled": "negative_pooled_prompt_embeds",
}
# For the time estimate only: the low end of what the H200 run measured with counted FLOPs
# (10% to 32%: docs/benchmarks/gpu/2026-12-04b.json's timings), so a phase is not started late.
ASSUMED_MFU = 0.15


def figure(x: float) -> float:
    """Four significant digits (a tiny model's MFU is far below 1e-4)."""
    return float(f"{x:.4g}")


def family_of(arch: str):
    for name in FAMILIES:
        family = get_family(name)
        if arch in family.published_configs:
            return family
    raise SystemExit(f"--arch {arch}: not a published architecture of the families {FAMILIES}")


def component_configs(family, arch: str, tiny: bool, cache_dir: str):
    """(transformer, VAE, scheduler) configs: the published architecture's, or with `tiny`
    the family's tiny model's (built offline on first use)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    if tiny:
        root = family.tiny_path(cache_dir, 0)
        vae = AutoencoderKL.load_config(str(root), subfolder="vae")
        return (
            family.transformer_config(root),
            vae,
            FlowMatchEulerDiscreteScheduler.load_config(str(root), subfolder="scheduler"),
        )
    transformer = arch_config(family, arch)
    vae = json.loads((resources.files("omni") / "models" / "configs" / family.published_vae_config).read_text())
    return transformer, vae, family.published_scheduler_config(transformer)


def arch_settings(arch: str, family, configs, args) -> dict:
    """The settings of one architecture's run: the command line's, else the architecture's."""
    transformer_config, vae_config, _ = configs
    defaults = ARCH_SETTINGS[arch]
    guidance = defaults["guidance"] if args.guidance is None else args.guidance
    t5_tokens = defaults["t5_tokens"] if args.text_tokens is None else args.text_tokens
    if args.tiny:
        t5_tokens = min(t5_tokens, TINY_T5_TOKENS)
    vae_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
    if args.resolution % (2 * vae_factor):
        raise SystemExit(
            f"--resolution {args.resolution}: {family.name} takes multiples of {2 * vae_factor} (the VAE's factor "
            f"{vae_factor} times 2x2 patches)"
        )
    latent_side = args.resolution // vae_factor
    return {
        "arch": f"tiny-{family.name}" if args.tiny else arch,
        "family": family.name,
        "device": args.device,
        "dtype": args.dtype,
        "resolution": args.resolution,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "guidance": guidance,
        "passes": family.forward_passes(guidance),
        "t5_tokens": t5_tokens,
        # tokens of the text alone (SD3: CLIP's 77 and T5's; FLUX: T5's)
        "text_tokens": family.sequence_length(transformer_config, 0, t5_tokens),
        "image_tokens": (latent_side // 2) ** 2,  # both families cut latents into 2x2 patches
        "vae_factor": vae_factor,
        "lora_rank": args.lora_rank,
        "lora_dtype": args.lora_dtype,
        "cudnn_attention": args.cudnn_attention,
        "repeats": args.repeats,
    }


class Budget:
    """What is left of --time-budget-s: a phase whose estimate (its FLOPs at ASSUMED_MFU of
    the peak) does not fit is skipped, with a note."""

    def __init__(self, seconds: float, peak_flops: float):
        self.deadline, self.flops_per_s = time.monotonic() + seconds, peak_flops * ASSUMED_MFU

    def seconds(self, flops: float) -> float:
        return flops / self.flops_per_s

    def fits(self, what: str, flops: float, notes: list) -> bool:
        need, left = self.seconds(flops), self.deadline - time.monotonic()
        if need <= left:
            return True
        notes.append(f"{what}: skipped, estimated {need:.0f} s but {max(left, 0):.0f} s left of --time-budget-s")
        return False


def build_pipeline(
    family, configs, lora_rank: int, device: torch.device, dtype: torch.dtype, lora_dtype: str = "float32"
):
    """The family's diffusers pipeline around a random transformer (in `dtype`, LoRA attached
    in fp32 as the recipes keep it, or in `dtype` with lora_dtype="model"), a random VAE
    (fp32) and the scheduler; no text encoders or tokenizers."""
    import diffusers

    transformer_config, vae_config, scheduler_config = configs
    torch.manual_seed(0)
    with torch.device(device):
        transformer = getattr(diffusers, family.transformer_class).from_config(transformer_config).to(dtype)
        vae = diffusers.AutoencoderKL.from_config(vae_config).float()
    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    add_lora_adapter(transformer, LoraConfig(rank=lora_rank, alpha=lora_rank, target_modules=list(family.lora_targets)))
    if lora_dtype == "model":
        for name, param in transformer.named_parameters():
            if is_lora_name(name):
                param.data = param.data.to(dtype)
    cls = getattr(diffusers, family.pipeline_class)
    absent = {
        name: None
        for name in inspect.signature(cls.__init__).parameters
        if name not in ("self", "transformer", "vae", "scheduler")
    }
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    pipe = cls(transformer=transformer, vae=vae, scheduler=scheduler, **absent)
    pipe.set_progress_bar_config(disable=True)
    # diffusers' pipelines hand the VAE latents in the transformer's dtype: decode them in fp32, as ours does
    first = vae.post_quant_conv if vae.post_quant_conv is not None else vae.decoder
    first.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))
    return pipe


def random_conditioning(family, transformer_config: dict, settings: dict, device: torch.device, dtype: torch.dtype):
    """Random conditioning of the family's real shapes: sequence embeddings over the text
    tokens, pooled embeddings, and the negatives when guidance takes two passes."""
    generator = torch.Generator().manual_seed(1)
    sequence = (settings["batch"], settings["text_tokens"], transformer_config["joint_attention_dim"])
    pooled = (settings["batch"], transformer_config["pooled_projection_dim"])
    tensors = {}
    for name in family.conditioning.field_names():
        if settings["passes"] == 2 or not name.startswith("neg_"):
            tensors[name] = torch.randn(*(pooled if "pooled" in name else sequence), generator=generator).to(
                device, dtype
            )
    return family.conditioning(**tensors)


def meta_inputs(family, transformer_config: dict, settings: dict):
    """`inputs(meta, n)`: the (cond, latents, sigmas) of n sequences of the run's shapes on the
    meta device, for the counted FLOPs (`omni.flops.forward_flops`)."""

    def inputs(meta, n: int):
        pipe = SimpleNamespace(transformer=meta, vae_scale_factor=settings["vae_factor"])
        generators = [torch.Generator().manual_seed(i) for i in range(n)]
        latents = family.initial_latents(pipe, generators, settings["resolution"]).to("meta")
        meta_device = torch.device("meta")
        cond = random_conditioning(family, transformer_config, {**settings, "batch": n}, meta_device, torch.float32)
        return cond, latents, torch.full((n,), 0.5, device=meta_device)

    return inputs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int):
    """(best seconds of `repeats` calls after a warm-up, peak GiB over all of them or None off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    return min(times), peak


def bench_rollout(family, pipe, cond, settings: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Seconds per rollout call of ours and of the plain pipeline, and our peak memory."""
    steps, resolution, guidance = settings["steps"], settings["resolution"], settings["guidance"]
    options = SamplingOptions(steps, resolution, guidance, 0.7, settings["t5_tokens"], sde_steps=(0, steps))
    seeds = list(range(settings["batch"]))
    embeds = {PIPELINE_ARGS[name]: t for name, t in cond.tensors().items()}

    def ours():
        sigmas = family.sigmas(pipe, steps, resolution)
        sample_trajectories(family, pipe, cond, seeds, sigmas, options, device, dtype)

    def plain():
        generators = [torch.Generator(device).manual_seed(s) for s in seeds]
        pipe(
            **embeds,
            **family.pipeline_guidance(guidance),
            num_inference_steps=steps,
            height=resolution,
            width=resolution,
            generator=generators,
            output_type="pt",
        )

    ours_s, ours_peak = timed(ours, device, settings["repeats"])
    plain_s, plain_peak = timed(plain, device, settings["repeats"])
    return {"ours_s": ours_s, "plain_s": plain_s, "peak_gib": ours_peak, "diffusers_peak_gib": plain_peak}


def bench_update(
    family, pipe, cond, settings: dict, cfg_gradient: str, device: torch.device, dtype: torch.dtype
) -> dict:
    """Seconds of one micro-batch's forward and backward, and the peak memory, without and
    with gradient checkpointing."""
    transformer, micro = pipe.transformer, settings["micro_batch"]
    generators = [torch.Generator().manual_seed(s) for s in range(micro)]
    latent = family.initial_latents(pipe, generators, settings["resolution"]).to(device, dtype)
    sigma = torch.full((micro,), 0.5, device=device)
    micro_cond = cond.apply(lambda t: t[:micro])

    def update():
        velocity = family.predict_velocity(
            transformer, latent, sigma, micro_cond, settings["guidance"], uncond_grad=cfg_gradient == "both"
        )
        velocity.square().mean().backward()

    seconds, peaks = {}, {}
    for checkpointing in (False, True):
        transformer.enable_gradient_checkpointing() if checkpointing else transformer.disable_gradient_checkpointing()
        transformer.train(checkpointing)  # diffusers checkpoints only in training mode
        key = "checkpointing" if checkpointing else "plain"
        seconds[key], peaks[key] = timed(update, device, settings["repeats"])
    transformer.disable_gradient_checkpointing()
    transformer.eval()
    transformer.zero_grad(set_to_none=True)
    return {"seconds": seconds, "peak_gib": peaks}


def failure(error: Exception) -> str:
    """A phase's error, with where it was raised (CUDA reports a kernel's fault at a later
    call unless CUDA_LAUNCH_BLOCKING=1)."""
    where = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {str(error).splitlines()[0]} (at {where.name}, line {where.lineno})"


def ratio_noise_floor(family, pipe, cond, settings: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The importance ratios an update starts from when nothing changed: one rollout call of
    the whole batch, re-scored by the actor (`rescore_log_probs`) one micro-batch at a time,
    as an update does. In fp32 on the CPU they are 1 to ~1e-6; in bf16 the kernels' other
    shapes give the noise floor a parity check between actor and engine must tolerate."""
    steps, resolution = settings["steps"], settings["resolution"]
    options = SamplingOptions(steps, resolution, settings["guidance"], 0.7, settings["t5_tokens"], sde_steps=(0, steps))
    sigmas = family.sigmas(pipe, steps, resolution)
    latents, log_probs, _, _ = sample_trajectories(
        family, pipe, cond, list(range(settings["batch"])), sigmas, options, device, dtype
    )
    cpu_cond = cond.apply(lambda t: t.cpu())
    batch = RolloutBatch([""] * len(latents), None, latents, log_probs, sigmas.cpu(), cpu_cond, options)
    micro = settings["micro_batch"]
    rescored = torch.cat([
        rescore_log_probs(family, pipe.transformer, batch.select(slice(i, i + micro), with_images=False), dtype)
        for i in range(0, len(batch), micro)
    ])  # fmt: skip
    deviation = (rescored - log_probs).exp().sub(1).abs()
    return {
        "mean_abs_ratio_minus_1": figure(deviation.mean().item()),
        "max_abs_ratio_minus_1": figure(deviation.max().item()),
        "max_abs_log_prob_diff": figure((rescored - log_probs).abs().max().item()),
    }


def estimated_train_gib(family, transformer_config: dict, settings: dict, dtype: str) -> dict:
    """omni.memory's estimate of the training phase for the update's micro-batch (one device,
    no sharding, text encoders offloaded as the benchmark has none), without and with
    gradient checkpointing: what `scripts/estimate_memory.py` would print for this setting."""
    lora = LoraConfig(rank=settings["lora_rank"], alpha=settings["lora_rank"], target_modules=list(family.lora_targets))
    sizes = count(family, transformer_config, lora)
    tokens = settings["text_tokens"] + settings["image_tokens"]
    return {
        ("checkpointing" if c else "plain"): estimate(
            sizes, tokens, settings["micro_batch"], 1, 0, dtype, settings["passes"], c)["train_phase"]
        for c in (False, True)
    }  # fmt: skip


def estimate_error(measured: dict, estimated: dict) -> dict:
    """(estimate - measured) / measured in % for each setting measured on CUDA."""
    return {k: round(100 * (estimated[k] - v) / v, 1) for k, v in measured.items() if v}


def rollout_report(measured: dict, settings: dict, model_flops: float, peak_flops: float) -> dict:
    batch = settings["batch"]
    return {
        "ours_images_per_s": figure(batch / measured["ours_s"]),
        "diffusers_images_per_s": figure(batch / measured["plain_s"]),
        "ours_over_diffusers": figure(measured["plain_s"] / measured["ours_s"]),
        "peak_gib": measured["peak_gib"],
        "diffusers_peak_gib": measured["diffusers_peak_gib"],
        "mfu": figure(model_flops / measured["ours_s"] / peak_flops),
    }


def update_report(measured: dict, settings: dict, model_flops: float, peak_flops: float) -> dict:
    seconds = measured["seconds"]
    return {
        "transitions_per_s": {k: figure(settings["micro_batch"] / s) for k, s in seconds.items()},
        "peak_gib": measured["peak_gib"],
        "mfu": {k: figure(model_flops / s / peak_flops) for k, s in seconds.items()},
    }


def bench_arch(arch: str, args, budget: Budget) -> dict:
    """One architecture's section: its settings, the estimate, and what fitted the budget."""
    device, dtype, peak = torch.device(args.device), DTYPES[args.dtype], args.peak_tflops * 1e12
    family = family_of(arch)
    configs = component_configs(family, arch, args.tiny, args.cache_dir)
    settings = arch_settings(arch, family, configs, args)
    plan = flops_plan(family, configs[0], settings, meta_inputs(family, configs[0], settings))
    settings["params"] = plan["params"]
    section = {
        "settings": settings,
        "estimated_s": {k: figure(budget.seconds(f)) for k, f in plan["total"].items()},
        "skipped": [],
    }
    if args.estimate or not budget.fits(
        "the architecture (its rollout first)", plan["total"]["rollout"], section["skipped"]
    ):
        return section
    pipe = build_pipeline(family, configs, args.lora_rank, device, dtype, args.lora_dtype)
    cond = random_conditioning(family, configs[0], settings, device, dtype)
    try:
        rollout = bench_rollout(family, pipe, cond, settings, device, dtype)
    except RuntimeError as e:
        section["rollout"] = {"error": failure(e)}
        return section
    section["rollout"] = rollout_report(rollout, settings, plan["per_call"]["rollout"], peak)
    section["update"] = {}
    for grad in cfg_gradients(settings):
        key = f"update {grad}"
        if budget.fits(key, plan["total"][key], section["skipped"]):
            try:
                measured = bench_update(family, pipe, cond, settings, grad, device, dtype)
            except RuntimeError as e:  # recorded, so the parts that still can run do
                section["update"][grad] = {"error": failure(e)}
                continue
            section["update"][grad] = update_report(measured, settings, plan["per_call"][key], peak)
            if grad == "both":  # what omni.memory models: every pass differentiated
                estimated = estimated_train_gib(family, configs[0], settings, args.dtype)
                section["update"][grad]["estimated_gib"] = estimated
                section["update"][grad]["estimate_error_pct"] = estimate_error(measured["peak_gib"], estimated)
    try:
        section["ratio_noise_floor"] = ratio_noise_floor(family, pipe, cond, settings, device, dtype)
    except RuntimeError as e:
        section["ratio_noise_floor"] = {"error": failure(e)}

    def collect():
        collect_lora_params(pipe.transformer, False, True, True, "default", family.layer_prefixes)

    try:
        section["lora_collect_seconds"] = figure(timed(collect, device, args.repeats)[0])
    except RuntimeError as e:
        section["lora_collect_seconds"] = {"error": failure(e)}
    return section


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        action="append",
        choices=sorted(ARCH_SETTINGS),
        help="repeatable; default: " + ", ".join(DEFAULT_ARCHS),
    )
    parser.add_argument(
        "--tiny", action="store_true", help="each arch's family's tiny model instead (checks the script)"
    )
    parser.add_argument("--estimate", action="store_true", help="print the settings and the time estimate only")
    parser.add_argument("--cache-dir", default="~/.cache/omni-recipes", help="where the tiny models are built")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="images per rollout call")
    parser.add_argument("--micro-batch", type=int, default=4, help="transitions per update forward/backward")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, help="default: the architecture's (SD3.5-Medium 4.5, FLUX.1-dev 3.5)")
    parser.add_argument(
        "--text-tokens", type=int, help="T5 tokens (model.max_sequence_length); default: the pipeline's"
    )
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument(
        "--lora-dtype",
        default="float32",
        choices=("float32", "model"),
        help="the LoRA's weights: fp32 as the recipes keep them, or the transformer's dtype",
    )
    parser.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let SDPA pick cuDNN's attention (its backward faulted on FLUX.1-dev, torch 2.11, H200)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100/H200: 989)"
    )
    parser.add_argument(
        "--time-budget-s", type=float, default=420.0, help="skip what would not fit (estimated) in this"
    )
    args = parser.parse_args(argv)
    if not 0 < args.micro_batch <= args.batch:
        parser.error(
            f"--micro-batch {args.micro_batch}: 1 to --batch ({args.batch}); the update takes its rows from the "
            "rollout's"
        )
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not args.cudnn_attention:
        disable_cudnn_attention()
    budget = Budget(args.time_budget_s, args.peak_tflops * 1e12)
    start, report = time.monotonic(), {}
    for arch in args.arch or DEFAULT_ARCHS:
        section = bench_arch(arch, args, budget)
        report[section["settings"]["arch"]] = section
        gc.collect()
        if torch.cuda.is_available():
            try:
                torch.cuda.empty_cache()
            except RuntimeError as e:  # a fault of this section's, reported late: keep what was measured
                section["cuda_error_after"] = failure(e)
                break
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
