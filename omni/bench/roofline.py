"""The CPU roofline of a Flow-GRPO training step (`scripts/bench_train.py --parts roofline`):
the FLOPs each phase of the step runs over its measured seconds, against this machine's
measured fp32 matmul rate at the same threads.

- FLOPs are counted, not modelled: the step's rollout (sampling and decoding) and its update
  (forwards and backwards, every minibatch) run once more under torch's `FlopCounterMode`,
  which adds up every matmul, convolution and attention by its shapes (the LoRA's, the VAE's
  and the text encoders' included); elementwise work, the optimizer and the reward are not
  FLOPs there: they are part of where the rest of the time goes. A model of the transformer
  alone (`omni.flops`, 2 x weights x tokens) would count an MMDiT block's text and image
  weights on every token, twice their work.
- The limits: a large square matmul (the rate the machine reaches at all) and a matmul of the
  transformer's widest linear at the update's micro-batch of tokens (what its shapes allow).
"""

from __future__ import annotations

import time
from typing import Dict

import torch
from torch.utils import flop_counter

from omni.context import update_seed
from omni.weights import is_lora_name

SQUARE = 1024  # the large matmul's side


def matmul_gflops(m: int, k: int, n: int, repeats: int = 5) -> float:
    """Best-of-`repeats` fp32 GFLOP/s of an (m x k) @ (k x n) matmul, after a warm-up."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    calls = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOPs a timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n * calls / best / 1e9


def widest_linear(transformer) -> torch.nn.Linear:
    linears = [
        m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and not is_lora_name(name)
    ]
    return max(linears, key=lambda m: m.weight.numel())


def image_tokens(latents: torch.Tensor, patch_size) -> int:
    """The image tokens the transformer sees per sequence: a packed latent (B, tokens, channels)
    has them as its rows; an unpacked one (B, C, H, W) or (B, C, F, H, W) is cut into patches of
    `patch_size` (an int for each spatial side, or one size per axis, as Wan's (1, 2, 2))."""
    if latents.ndim == 3:
        return latents.shape[1]
    axes = latents.shape[2:]
    patch = tuple(patch_size) if isinstance(patch_size, (list, tuple)) else (patch_size,) * 2
    patch = (1,) * (len(axes) - len(patch)) + patch
    count = 1
    for side, size in zip(axes, patch):
        count *= side // size
    return count


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


# torch counts the GPU kernels of scaled_dot_product_attention (and the meta device's), not the
# CPU's flash attention, which it would count as 0
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def counted(fn) -> tuple:
    """(FLOPs, result) of `fn()` as torch's FlopCounterMode counts them (the CPU's attention too)."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        result = fn()
    return counter.get_total_flops(), result


def step_flops(trainer, step: int) -> Dict[str, float]:
    """FLOPs of training step `step`'s rollout and update, counted (its weights then move on)."""
    algorithm = trainer.algorithm
    rollout_flops, rollout = counted(lambda: algorithm.rollout(step))
    batch, _ = algorithm.update_batch(rollout)
    seed = update_seed(trainer.cfg.seed, step)
    update_flops, _ = counted(lambda: trainer.worker.apply_update(algorithm.update, batch, seed))
    image = image_tokens(batch.rollout.latents, trainer.worker.actor.config.patch_size)
    text = max(t.shape[1] for t in batch.rollout.cond.tensors().values() if t.ndim >= 3)
    return {"rollout": rollout_flops, "update": update_flops, "tokens_per_sequence": text + image}


def roofline(trainer, seconds: Dict[str, float], step: int) -> dict:
    """Each phase's GFLOP/s and its fraction of the two limits; `seconds`: a step's phases
    (`time/rollout`, `time/update`, ...) and the whole `step`; `step`: a step to count."""
    flops = step_flops(trainer, step)
    wide = widest_linear(trainer.worker.actor)
    tokens = flops["tokens_per_sequence"] * trainer.cfg.trainer.micro_batch_size
    limits = {
        "square_matmul_gflops": matmul_gflops(SQUARE, SQUARE, SQUARE),
        "model_shape_matmul_gflops": matmul_gflops(tokens, wide.in_features, wide.out_features),
    }
    phases = {}
    for phase in ("rollout", "update"):
        rate = flops[phase] / seconds[f"time/{phase}"] / 1e9
        phases[phase] = {
            "gflop": round(flops[phase] / 1e9, 3),
            "seconds": round(seconds[f"time/{phase}"], 4),
            "gflops": round(rate, 2),
            "of_square_matmul": round(rate / limits["square_matmul_gflops"], 3),
            "of_model_shape_matmul": round(rate / limits["model_shape_matmul_gflops"], 3),
        }
    total = flops["rollout"] + flops["update"]
    step_rate = total / seconds["step"] / 1e9
    shares = {k.split("/")[1]: round(v / seconds["step"], 3) for k, v in seconds.items() if k.startswith("time/")}
    return {
        "tokens_per_sequence": flops["tokens_per_sequence"],
        "limits": {k: round(v, 1) for k, v in limits.items()},
        "phases": phases,
        "step": {
            "gflop": round(total / 1e9, 3),
            "seconds": round(seconds["step"], 4),
            "gflops": round(step_rate, 2),
            "of_square_matmul": round(step_rate / limits["square_matmul_gflops"], 3),
            "time_shares": shares,
        },
    }
