"""JPEG compressibility (DDPO / Flow-GRPO): minus the JPEG size in kilobytes."""

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omni.rewards.base import Reward, RewardOptions


def jpeg_size_kb(image: torch.Tensor, quality: int = 95) -> float:
    array = (image.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


def jpeg_compressibility(images: torch.Tensor, prompts, quality: int = 95) -> torch.Tensor:
    return torch.tensor([-jpeg_size_kb(image, quality) for image in images])


@dataclass
class JpegOptions(RewardOptions):
    # JPEG quality the size is measured at (DDPO's is 95).
    quality: int = 95


class JpegCompressibility(Reward):
    Options = JpegOptions

    def score(self, images, prompts):
        return jpeg_compressibility(images, prompts, self.options.quality)


REWARD = JpegCompressibility
