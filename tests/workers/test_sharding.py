"""Gradient clipping whatever the wrapping: `trainer.max_grad_norm=0` turns it off (torch's own
clip with 0 would scale every gradient to 0 and silently stop training), and a positive bound
scales the gradient down to it; the norm before clipping is returned either way."""

import pytest
import torch

from omni.workers.sharding import clip_grad_norm


def gradients(scale: float):
    module = torch.nn.Linear(4, 3)
    for p in module.parameters():
        p.grad = torch.full_like(p, scale)
    return module, list(module.parameters())


def global_norm(params) -> float:
    return float(torch.cat([p.grad.flatten() for p in params]).norm())


@pytest.mark.parametrize("max_norm, expected", [(0.0, 2.0 * 15**0.5), (1.0, 1.0), (100.0, 2.0 * 15**0.5)])
def test_clip_grad_norm_bounds_the_norm_and_zero_means_no_clipping(max_norm, expected):
    module, params = gradients(2.0)
    norm = clip_grad_norm(module, params, max_norm)
    assert float(norm) == pytest.approx(2.0 * 15**0.5)
    assert global_norm(params) == pytest.approx(expected, rel=1e-5)
