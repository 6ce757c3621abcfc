"""Coefficients-Preserving Sampling's step (Wang and Yu 2025) against hand-computed values."""

import math

import pytest
import torch

from omni.rollout.sde import cps_mean_and_scale, gaussian_log_prob, is_noisy_step, ode_step, sde_step


def test_mean_and_scale_hand_computed():
    """x = 1, v = 0.5, sigma 0.8 -> 0.6, eta 0.5: x0 = 1 - 0.8 * 0.5 = 0.6, x1 = 1 + 0.2 * 0.5 = 1.1,
    mean = 0.4 * 0.6 + 0.6 cos(pi/4) 1.1, std = 0.6 sin(pi/4)."""
    x, v = torch.full((1, 1, 1, 1), 1.0), torch.full((1, 1, 1, 1), 0.5)
    mean, scale = cps_mean_and_scale(v, x, 0.8, 0.6, 0.5)
    assert math.isclose(mean.item(), 0.24 + 0.6 * math.sqrt(0.5) * 1.1, rel_tol=1e-6)
    assert math.isclose(float(scale), 0.6 * math.sqrt(0.5), rel_tol=1e-6)
    drawn, log_prob, _, _ = sde_step(v, x, 0.8, 0.6, 0.95, 0.5, noise=torch.ones(1, 1, 1, 1), sde_type="cps")
    assert math.isclose(drawn.item(), mean.item() + 0.6 * math.sqrt(0.5), rel_tol=1e-6)
    assert math.isclose(
        log_prob.item(), -0.5 - math.log(0.6 * math.sqrt(0.5)) - 0.5 * math.log(2 * math.pi), rel_tol=1e-6
    )


def test_the_step_keeps_the_marginal_coefficients():
    """On the straight path x = (1 - s) x0 + s x1 with the exact velocity x1 - x0, the step to
    s' is (1 - s') x0 + s' cos x1 + s' sin eps: x0's coefficient is the marginal's, and the
    noise (x1 and the fresh eps) has total std s', as the marginal at s' has."""
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(2, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    sigma, sigma_next, eta = 0.7, 0.4, 0.6
    mean, scale = cps_mean_and_scale(x1 - x0, (1 - sigma) * x0 + sigma * x1, sigma, sigma_next, eta)
    cos = math.cos(eta * math.pi / 2)
    assert torch.allclose(mean, (1 - sigma_next) * x0 + sigma_next * cos * x1, atol=1e-6)
    assert math.isclose(float(scale) ** 2 + (sigma_next * cos) ** 2, sigma_next**2, rel_tol=1e-6)


def test_no_noise_is_the_euler_step():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    mean, scale = cps_mean_and_scale(v, x, 0.9, 0.5, 1e-8)
    assert torch.allclose(mean, ode_step(v, x, 0.9, 0.5), atol=1e-6) and float(scale) < 1e-7


def test_rescoring_gives_the_drawn_log_prob_and_the_step_to_zero_is_refused():
    g = torch.Generator().manual_seed(2)
    x, v, noise = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    drawn, log_prob, mean, scale = sde_step(v, x, 0.8, 0.6, 0.95, 0.7, noise=noise, sde_type="cps")
    _, rescored, _, _ = sde_step(v, x, 0.8, 0.6, 0.95, 0.7, next_sample=drawn, sde_type="cps")
    assert torch.allclose(log_prob, rescored) and torch.allclose(log_prob, gaussian_log_prob(drawn, mean, scale))
    _, sde_log_prob, _, _ = sde_step(v, x, 0.8, 0.6, 0.95, 0.7, next_sample=drawn)
    assert not torch.allclose(log_prob, sde_log_prob)  # a different step, not a renamed one
    with pytest.raises(ValueError, match="sigma 0"):
        sde_step(v, x, 0.1, 0.0, 0.95, 0.7, noise=noise, sde_type="cps")
    assert not is_noisy_step("cps", 0.0) and is_noisy_step("cps", 0.1) and is_noisy_step("sde", 0.0)
    with pytest.raises(ValueError, match="sde or cps"):
        sde_step(v, x, 0.8, 0.6, 0.95, 0.7, noise=noise, sde_type="ddim")
