"""The FLOPs model of the transformer and the facts of each published architecture as its
pipeline runs it, for the GPU benchmark's MFU and its time estimate (`omni.bench.gpu`).

Per forward: 2 x linear weights (the LoRA's left out) x tokens plus attention's
4 x tokens^2 x width per block (SD3.5-Medium's extra image-only attention in 13 blocks, ~1.5%,
is left out). An update counts one more forward for each differentiated pass's backward (the
base is frozen: no weight gradients) and one more under gradient checkpointing; the VAE is
not counted.
"""

from __future__ import annotations

import torch

from omni.weights import is_lora_name

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


def forward_flops(transformer, family, tokens: int, sequences: int) -> float:
    """Matmul FLOPs of one forward of `sequences` sequences of `tokens` tokens (see the module
    docstring); `transformer` may be on the meta device."""
    linear = sum(
        m.weight.numel()
        for name, m in transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and not is_lora_name(name)
    )
    blocks = sum(len(transformer.get_submodule(prefix.rstrip("."))) for prefix in family.layer_prefixes)
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    return sequences * (2 * linear * tokens + 4 * blocks * tokens**2 * width)


def update_forwards(cfg_gradient: str, passes: int, checkpointing: bool) -> int:
    """Forwards of one micro-batch an update runs: each differentiated pass once, its backward
    once more, its recompute under checkpointing once more; `conditional` runs CFG's
    unconditional pass once, without gradients."""
    differentiated = 1 if cfg_gradient == "conditional" else passes
    return differentiated * (2 + checkpointing) + (passes - differentiated)


def cfg_gradients(settings: dict):
    """The `algorithm.cfg_gradient` values the family takes at this guidance."""
    return CFG_GRADIENTS if settings["passes"] == 2 else CFG_GRADIENTS[:1]


def flops_plan(family, transformer_config: dict, settings: dict) -> dict:
    """Model FLOPs of one call of each timed phase, and the FLOPs each phase runs in all
    (warm-up and repeats, checkpointing's recompute included) for the time estimate."""
    meta = family.meta_transformer(config=transformer_config)
    tokens = settings["text_tokens"] + settings["image_tokens"]
    calls = 1 + settings["repeats"]
    per_call = {
        "rollout": settings["steps"] * forward_flops(meta, family, tokens, settings["batch"] * settings["passes"])
    }
    one = forward_flops(meta, family, tokens, settings["micro_batch"])
    total = {"rollout": 2 * calls * per_call["rollout"]}  # ours and the plain pipeline
    for grad in cfg_gradients(settings):
        per_call[f"update {grad}"] = update_forwards(grad, settings["passes"], False) * one
        total[f"update {grad}"] = calls * sum(update_forwards(grad, settings["passes"], c) * one for c in (False, True))
    return {"params": sum(p.numel() for p in meta.parameters()), "per_call": per_call, "total": total}
