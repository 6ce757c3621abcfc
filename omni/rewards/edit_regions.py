"""What the edit rewards compare a result with: its prompt's source and target images, at the
result's size, and the region the edit changes.

The changed region is where the target differs from the source (any channel by more than
`threshold`); without a target, the white pixels of the image named by the metadata's "mask",
if any; else nothing (the whole image is kept). Images are read once and kept (a run scores
the same few edits again and again).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from omni.data.prompts import source_images
from omni.rewards.base import RewardOptions


@dataclass
class EditRegionOptions(RewardOptions):
    # A pixel belongs to the changed region when the target differs from the source there by
    # more than this (in [0, 1], any channel).
    threshold: float = 0.1


@functools.lru_cache(maxsize=4096)
def _read(path: str, mode: str) -> torch.Tensor:
    with Image.open(path) as image:
        pixels = np.asarray(image.convert(mode), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels.reshape(*pixels.shape[:2], -1)).permute(2, 0, 1).contiguous()


def read_image(path: str, size: Tuple[int, int], mode: str = "RGB") -> torch.Tensor:
    """The image at `path` as (C, H, W) in [0, 1], resized (bilinear) to `size` if it differs."""
    image = _read(str(path), mode)
    if tuple(image.shape[-2:]) != tuple(size):
        image = F.interpolate(image[None], size=tuple(size), mode="bilinear", align_corners=False)[0]
    return image


def references(prompt, size: Tuple[int, int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the first source image, the target or None), each (3, H, W) at `size`."""
    target = prompt.metadata.get("target") if hasattr(prompt, "metadata") else None
    source = read_image(source_images(prompt)[0], size)
    return source, None if target is None else read_image(target, size)


def changed_region(prompt, source: torch.Tensor, target: Optional[torch.Tensor], threshold: float) -> torch.Tensor:
    """(H, W) bool: the pixels the edit changes (see the module docstring)."""
    if target is not None:
        return (target - source).abs().amax(dim=0) > threshold
    mask = prompt.metadata.get("mask") if hasattr(prompt, "metadata") else None
    if mask is not None:
        return read_image(mask, source.shape[-2:], mode="L")[0] > 0.5
    return torch.zeros(source.shape[-2:], dtype=torch.bool)


def mean_closeness(image: torch.Tensor, reference: torch.Tensor, region: torch.Tensor) -> float:
    """1 - the mean absolute difference (over channels) inside `region`; the whole image when
    the region is empty."""
    difference = (image.float() - reference).abs().mean(dim=0)
    inside = difference[region] if region.any() else difference.flatten()
    return float(1 - inside.mean())
