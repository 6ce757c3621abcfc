"""The roofline's FLOP count (omni/bench/roofline.py): torch's counter misses the CPU's flash
attention, forward and backward, which the roofline counts as the GPU kernels are counted."""

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from omni.bench.roofline import counted


def test_the_cpu_attention_is_counted_forward_and_backward():
    q = torch.randn(1, 4, 64, 16, requires_grad=True)
    shape = tuple(q.shape)
    flops, _ = counted(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward())
    assert flops == sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape) > 0
    linear = torch.nn.Linear(16, 8)
    flops, _ = counted(lambda: linear(torch.randn(5, 16)))
    assert flops == 2 * 5 * 16 * 8
