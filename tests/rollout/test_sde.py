"""The SDE step's mean, scale and log-prob against hand-computed values."""

import math

import torch

from omni.rollout.sde import gaussian_log_prob, ode_step, sde_mean_and_scale, sde_std, sde_step, sde_window


def test_std_uses_sigma_max_at_sigma_one():
    assert torch.allclose(sde_std(torch.tensor(0.5), 0.9, 0.7), torch.tensor(0.7))
    assert torch.allclose(sde_std(torch.tensor(1.0), 0.9, 1.0), torch.tensor(math.sqrt(1 / 0.1)))


def test_mean_and_scale_hand_computed():
    x, v = torch.full((1, 1, 1, 1), 2.0), torch.full((1, 1, 1, 1), -1.0)
    mean, scale = sde_mean_and_scale(v, x, 0.5, 0.25, 0.9, 0.7)
    # std_t = 0.7, dt = -0.25: mean = 2 (1 - 0.49 * 0.25) + (-1)(1 + 0.245)(-0.25)
    assert math.isclose(mean.item(), 2 * (1 - 0.1225) + 1.245 * 0.25, rel_tol=1e-6)
    assert math.isclose(scale.item(), 0.7 * 0.5, rel_tol=1e-6)


def test_log_prob_is_gaussian_density_mean():
    x = torch.tensor([[0.0, 1.0]])
    mean = torch.zeros(1, 2)
    scale = torch.tensor(2.0)
    expected = sum(-(xi**2) / 8 - math.log(2) - 0.5 * math.log(2 * math.pi) for xi in (0.0, 1.0)) / 2
    assert math.isclose(gaussian_log_prob(x, mean, scale).item(), expected, rel_tol=1e-6)


def test_rescoring_a_drawn_step_gives_its_log_prob():
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    drawn, log_prob, _, _ = sde_step(v, x, 0.8, 0.6, 0.95, 0.7, noise=noise)
    _, rescored, _, _ = sde_step(v, x, 0.8, 0.6, 0.95, 0.7, next_sample=drawn)
    assert torch.allclose(log_prob, rescored)
    # the step's noise is standard normal: log-prob = mean of -eps^2/2 - log(scale) - log sqrt(2 pi)
    _, scale = sde_mean_and_scale(v, x, 0.8, 0.6, 0.95, 0.7)
    manual = (-(noise**2) / 2).mean(dim=(1, 2, 3)) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(log_prob, manual, atol=1e-5)


def test_ode_step_is_euler():
    x, v = torch.ones(1, 2), torch.full((1, 2), 3.0)
    assert torch.allclose(ode_step(v, x, 0.5, 0.25), torch.full((1, 2), 1 - 0.75))


def test_window():
    g = torch.Generator().manual_seed(0)
    assert sde_window(10, 0, None, g) == (0, 10)
    starts = {sde_window(10, 2, [1, 4], g)[0] for _ in range(200)}
    assert starts == {1, 2, 3, 4}
    assert all(stop - start == 2 for start, stop in (sde_window(10, 2, [1, 4], g) for _ in range(20)))
