"""Wrapping the actor transformer for training: no FSDP, FSDP1, or FSDP2 per block + root.

Without FSDP across several workers the base is replicated and only the trainable
parameters' gradients are averaged (`average_gradients`), as DDP would, in one collective.

The blocks are the children of the containers named by `model.fsdp.layer_prefixes`
(`transformer_blocks.` for SD3), so the units FSDP gathers are the units that
`collect_lora_params(layered_summon=True)` summons one at a time.

With a compute dtype below fp32 (`model.dtype=bfloat16`) the trainable parameters are fp32
masters next to a frozen base in the compute dtype. FSDP2 keeps each parameter's own dtype
(the base computes in bf16, the LoRA in fp32, as in the rollout engine); FSDP1 flattens each
unit into one tensor of a single dtype, so its whole module is made fp32 and `MixedPrecision`
computes everything, the LoRA too, in bf16. Gradients are reduced in fp32 in both.
"""

from __future__ import annotations

import functools
from typing import List, Sequence

import torch
from torch import nn


def block_names(module: nn.Module, layer_prefixes: Sequence[str]) -> List[str]:
    """Qualified names of the blocks under the prefixes (`transformer_blocks.0`, ...)."""
    names = []
    for prefix in layer_prefixes:
        container = module.get_submodule(prefix.rstrip("."))
        names += [f"{prefix}{name}" for name, _ in container.named_children()]
    return names


def wrap_fsdp(
    module: nn.Module,
    version: int,
    layer_prefixes: Sequence[str],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """`module` on `device`, unwrapped (version 0) or sharded per block; `dtype` is the
    compute dtype (the frozen base's)."""
    if version == 0:
        return module.to(device)
    blocks = [module.get_submodule(name) for name in block_names(module, layer_prefixes)]
    mixed = dtype != torch.float32
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        block_ids = {id(b) for b in blocks}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in block_ids)
        return FullyShardedDataParallel(
            module.to(device, torch.float32) if mixed else module.to(device),
            auto_wrap_policy=policy,
            use_orig_params=True,  # frozen base and trainable LoRA share units
            device_id=device,  # also on CPU: without it FSDP1 looks for an accelerator
            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
            if mixed
            else None,
        )
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        module.to(device)
        # each parameter computes in its own dtype (the base in `dtype`, the LoRA in fp32, as
        # in the rollout engine); gradients are reduced in fp32
        mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        for block in blocks:
            fully_shard(block, mp_policy=mp_policy)
        fully_shard(module, mp_policy=mp_policy)
        return module
    raise ValueError(f"model.fsdp.version={version}: expected 0 (none), 1 or 2")


def average_gradients(params: Sequence[torch.Tensor]) -> None:
    """Replicated workers: every gradient replaced by its mean over the workers, in one
    all-reduce of one flat fp32 buffer (a parameter without a gradient counts as zeros, so
    every worker sends the same layout)."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for p, part in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(p).to(p.dtype)


def clip_grad_norm(module: nn.Module, params, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm, whatever the wrapping; returns the norm before clipping.
    `max_norm` 0: no clipping (torch would scale every gradient to 0), the norm still measured."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    max_norm = max_norm if max_norm > 0 else float("inf")

    if isinstance(module, FullyShardedDataParallel):
        return module.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
