"""JPEG compressibility (DDPO / Flow-GRPO): minus the JPEG size in kilobytes at quality 95."""

import io

import numpy as np
import torch
from PIL import Image


def jpeg_size_kb(image: torch.Tensor) -> float:
    array = (image.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    return buffer.tell() / 1000


def jpeg_compressibility(images: torch.Tensor, prompts) -> torch.Tensor:
    return torch.tensor([-jpeg_size_kb(image) for image in images])
