"""The FLOPs of the transformer and the facts of each published architecture as its pipeline
runs it, for the GPU benchmark's MFU and its time estimate (`omni.bench.gpu`).

Per forward: counted, not modelled. One pass of the family's own `velocity_pass` runs on the
meta device (nothing computed, nothing allocated) under torch's `FlopCounterMode`, which adds
up every matmul and attention by its shapes. A model of 2 x linear weights x tokens would
charge an MMDiT block's separate text and image weights to every token and the adaLN
modulation (one vector per sample) to every token too: for SD3.5-Medium at 1024 px it counts
twice the work. An update counts one more forward for each differentiated pass's backward (the
base is frozen: no weight gradients) and one more under gradient checkpointing; the VAE is
not counted.
"""

from __future__ import annotations

import torch

# Guidance and T5 tokens of each published architecture as its pipeline runs it: the SD3.5
# model cards' guidance, StableDiffusion3Pipeline's max_sequence_length 256, FluxPipeline's
# 512 and dev's 3.5; schnell takes no guidance.
ARCH_SETTINGS = {
    "sd3.5-medium": dict(guidance=4.5, t5_tokens=256),
    "sd3.5-large": dict(guidance=3.5, t5_tokens=256),
    "flux.1-dev": dict(guidance=3.5, t5_tokens=512),
    "flux.1-schnell": dict(guidance=0.0, t5_tokens=256),
}
TINY_T5_TOKENS = 16  # the tiny models' tokenizer length
CFG_GRADIENTS = ("both", "conditional")


def forward_flops(family, meta, inputs, guidance_scale: float = 1.0) -> float:
    """FLOPs of one transformer pass on `inputs` (cond, latents, sigmas), meta tensors of the
    real shapes, counted on the meta transformer `meta` (see the module docstring): the
    family's velocity at `guidance_scale`, divided by its passes."""
    from torch.utils.flop_counter import FlopCounterMode

    cond, latents, sigmas = inputs
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        family.predict_velocity(meta, latents, sigmas, cond, guidance_scale)
    return float(counter.get_total_flops()) / family.forward_passes(guidance_scale)


def update_forwards(cfg_gradient: str, passes: int, checkpointing: bool) -> int:
    """Forwards of one micro-batch an update runs: each differentiated pass once, its backward
    once more, its recompute under checkpointing once more; `conditional` runs CFG's
    unconditional pass once, without gradients."""
    differentiated = 1 if cfg_gradient == "conditional" else passes
    return differentiated * (2 + checkpointing) + (passes - differentiated)


def cfg_gradients(settings: dict):
    """The `algorithm.cfg_gradient` values the family takes at this guidance."""
    return CFG_GRADIENTS if settings["passes"] == 2 else CFG_GRADIENTS[:1]


def flops_plan(family, transformer_config: dict, settings: dict, meta_inputs) -> dict:
    """Model FLOPs of one call of each timed phase, and the FLOPs each phase runs in all
    (warm-up and repeats, checkpointing's recompute included) for the time estimate;
    `meta_inputs(meta, n)`: (cond, latents, sigmas) of n sequences on the meta device."""
    meta = family.meta_transformer(config=transformer_config)
    calls = 1 + settings["repeats"]
    per_call = {
        "rollout": settings["steps"]
        * settings["passes"]
        * forward_flops(family, meta, meta_inputs(meta, settings["batch"]), settings["guidance"])
    }
    one = forward_flops(family, meta, meta_inputs(meta, settings["micro_batch"]), settings["guidance"])
    total = {"rollout": 2 * calls * per_call["rollout"]}  # ours and the plain pipeline
    for grad in cfg_gradients(settings):
        per_call[f"update {grad}"] = update_forwards(grad, settings["passes"], False) * one
        total[f"update {grad}"] = calls * sum(update_forwards(grad, settings["passes"], c) * one for c in (False, True))
    return {"params": sum(p.numel() for p in meta.parameters()), "per_call": per_call, "total": total}
