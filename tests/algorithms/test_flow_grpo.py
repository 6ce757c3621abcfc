"""The clipped ratio loss and the KL on hand-computed cases (the advantages: test_advantages.py)."""

import math

import pytest
import torch

from omni.algorithms.flow_grpo import (
    ScoredSteps,
    clipped_policy_loss,
    gaussian_step_kl,
    reference_kl,
    velocity_kl,
)
from omni.rollout.sde import sde_step


def test_clipped_loss_hand_computed():
    log_prob = torch.log(torch.tensor([1.5, 0.5, 1.05]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -2.0])
    loss, ratio, clip_fraction = clipped_policy_loss(log_prob, old, adv, clip_range=0.2)
    # sample 1: min(1.5, 1.2) -> 1.2 ; sample 2: min(0.5, 0.8) -> 0.5 ; sample 3: -2 * 1.05 (inside)
    assert math.isclose(loss.item(), -(1.2 + 0.5 - 2.1) / 3, rel_tol=1e-5)
    assert math.isclose(clip_fraction.item(), 2 / 3, rel_tol=1e-6)
    assert torch.allclose(ratio, torch.tensor([1.5, 0.5, 1.05]))


def test_on_policy_gradient_is_advantage_weighted():
    log_prob = torch.zeros(2, requires_grad=True)
    loss, _, _ = clipped_policy_loss(log_prob, torch.zeros(2), torch.tensor([2.0, -1.0]), 1e-4)
    loss.backward()
    assert torch.allclose(log_prob.grad, torch.tensor([-1.0, 0.5]))


def test_kl_zero_when_equal_and_hand_computed():
    mean = torch.randn(2, 3)
    assert torch.equal(gaussian_step_kl(mean, mean, torch.tensor(0.3)), torch.zeros(2))
    kl = gaussian_step_kl(torch.ones(1, 2), torch.zeros(1, 2), torch.tensor(0.5))
    assert math.isclose(kl.item(), 1 / (2 * 0.25), rel_tol=1e-6)


def test_velocity_kl_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    ref = torch.tensor([[1.0, 0.0, 3.0, 1.0]])
    assert math.isclose(velocity_kl(v, ref).item(), (0 + 4 + 0 + 9) / 4)


def test_latent_and_velocity_kl_of_one_sde_step():
    """Two velocities 1 apart everywhere, stepped from sigma 0.8 to 0.6 with noise level 0.7:
    std_t = 0.7 sqrt(0.8 / 0.2) = 1.4, the means differ by (1 + 1.4^2 0.2 / 1.6) 0.2 = 0.249
    and the step's std is 1.4 sqrt(0.2), so the latent KL is 0.249^2 / (2 1.96 0.2) = 0.0790829;
    the velocity KL is 1 whatever the step."""
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))

    def scored(velocity):
        _, log_prob, mean, scale = sde_step(velocity, x, 0.8, 0.6, 0.95, 0.7, next_sample=x)
        return ScoredSteps(log_prob, mean, scale, velocity)

    policy, ref = scored(v + 1), scored(v)
    assert torch.allclose(reference_kl(policy, ref, "latent"), torch.full((2,), 0.249**2 / (2 * 1.96 * 0.2)), rtol=1e-5)
    assert torch.allclose(reference_kl(policy, ref, "velocity"), torch.ones(2))
    with pytest.raises(ValueError, match="latent or velocity"):
        reference_kl(policy, ref, "score")
