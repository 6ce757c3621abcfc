"""The roofline's FLOP count (omni/bench/roofline.py): torch's counter misses the CPU's flash
attention, forward and backward, which the roofline counts as the GPU kernels are counted; and
the tokens a sequence has, for the matmul at the model's shape."""

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from omni.bench.roofline import counted, image_tokens


def test_the_cpu_attention_is_counted_forward_and_backward():
    q = torch.randn(1, 4, 64, 16, requires_grad=True)
    shape = tuple(q.shape)
    flops, _ = counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward())
    assert flops == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape) > 0
    linear = torch.nn.Linear(16, 8)
    flops, _ = counted(lambda: linear(torch.randn(5, 16)))
    assert flops == 2 * 5 * 16 * 8


def test_image_tokens_are_the_transformers_patches():
    from diffusers import SD3Transformer2DModel

    from omni.models.sd3 import TINY_TRANSFORMER

    transformer = SD3Transformer2DModel(**TINY_TRANSFORMER)
    latents = torch.randn(1, 4, 8, 12)
    assert image_tokens(latents, transformer.config.patch_size) == transformer.pos_embed(latents).shape[1] == 24
    assert image_tokens(torch.randn(2, 24, 64), 1) == 24  # packed (FLUX, Qwen-Image): a row a token
    assert image_tokens(torch.randn(1, 16, 3, 8, 8), (1, 2, 2)) == 48  # Wan: frames x 2x2 patches
