"""Devices and dtypes: the dtype names a config or a script's flag may give, and the
device settings the recipes apply before any model runs on a GPU.

cuDNN's fused attention (one of the backends PyTorch's scaled_dot_product_attention may pick
on CUDA) failed in its backward on FLUX.1-dev's shapes (H200, torch 2.11 with CUDA 13:
`mha_graph.execute(...) is_good()` false, then illegal memory accesses in later kernels),
and an SD3.5-Medium update once failed in cuBLAS after it. Flash and memory-efficient
attention cover the same shapes, so the recipes turn cuDNN's off.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype a name stands for; "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def disable_cudnn_attention() -> None:
    """SDPA without its cuDNN backend (flash and memory-efficient attention stay)."""
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
