"""Latents packed into 2x2 patches and the resolution-shifted noise schedule, as FLUX.1 and
Qwen-Image both use them (each pipeline draws (B, C, 2h', 2w') noise, packs it into one token
per 2x2 patch, and shifts linspace(1, 1/n, n) by `mu`, which grows with the number of image
tokens)."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) VAE latents -> (B, h/2 * w/2, 4C): one token per 2x2 patch."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, grid: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """The inverse of `pack`: `grid` is the tokens' (rows, columns), square when not given."""
    b, n, width = tokens.shape
    rows, cols = grid or (math.isqrt(n), math.isqrt(n))
    if rows * cols != n:
        raise ValueError(f"{n} tokens do not fill a grid of {rows} x {cols}")
    patches = tokens.reshape(b, rows, cols, width // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, width // 4, 2 * rows, 2 * cols)


def packed_noise(pipe, generators: Sequence[torch.Generator], resolution: int) -> torch.Tensor:
    """The initial latents, one image per generator, drawn unpacked as the pipelines draw them."""
    size = 2 * (resolution // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels // 4
    return pack(torch.stack([torch.randn(channels, size, size, generator=g) for g in generators]))


def shifted_sigmas(pipe, num_steps: int, resolution: int) -> torch.Tensor:
    """linspace(1, 1/n, n) shifted by the pipe's scheduler for this resolution's number of
    image tokens (mu, from the scheduler's config), then 0."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = pipe.scheduler.config
    mu = calculate_shift(
        (resolution // (pipe.vae_scale_factor * 2)) ** 2,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
    return pipe.scheduler.sigmas.float().clone()
