"""Advantages, clipping, the clipped ratio loss and the KL on hand-computed cases."""

import math

import pytest
import torch

from omni.algorithms.flow_grpo import (
    ScoredSteps,
    clip_advantages,
    clipped_policy_loss,
    gaussian_step_kl,
    group_advantages,
    masked_group_advantages,
    reference_kl,
    velocity_kl,
)
from omni.rollout.sde import sde_step


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0])
    adv = group_advantages(rewards, group_size=2, eps=1e-4)
    std = math.sqrt(2) + 1e-4  # unbiased std of (1, 3)
    assert torch.allclose(adv[:2], torch.tensor([-1 / std, 1 / std]))
    assert torch.allclose(adv[2:], torch.zeros(2))  # a tie gives no signal


def test_global_std():
    rewards = torch.tensor([1.0, 3.0, 5.0, 7.0])
    adv = group_advantages(rewards, group_size=2, norm="global", eps=0.0)
    # batch std of (1, 3, 5, 7): sqrt(((9 + 1 + 1 + 9) / 3)) = sqrt(20 / 3)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / math.sqrt(20 / 3))


def test_no_std_division_as_in_dr_grpo():
    rewards = torch.tensor([1.0, 3.0, 10.0, 16.0])
    adv = group_advantages(rewards, group_size=2, norm="none")
    # r - group mean only: group means 2 and 13
    assert torch.equal(adv, torch.tensor([-1.0, 1.0, -3.0, 3.0]))


@pytest.mark.parametrize("norm", ["group", "global", "none"])
def test_masked_advantages_leave_out_invalid_rewards(norm):
    """A non-finite reward gets advantage 0 and its group is normalised over the others."""
    rewards = torch.tensor([1.0, 3.0, 5.0, float("nan"), 2.0, 8.0])
    valid = torch.isfinite(rewards)
    adv = masked_group_advantages(rewards, valid, group_size=3, norm=norm, eps=0.0)
    # group 1: (1, 3, 5), mean 3, std 2; group 2: (2, 8), mean 5, std sqrt(18); batch std of the 5
    batch_std = math.sqrt(sum((r - 3.8) ** 2 for r in (1, 3, 5, 2, 8)) / 4)
    scale = {"group": (2.0, math.sqrt(18)), "global": (batch_std, batch_std), "none": (1.0, 1.0)}[norm]
    expected = [-2 / scale[0], 0.0, 2 / scale[0], 0.0, -3 / scale[1], 3 / scale[1]]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_unknown_normalisation_is_refused():
    with pytest.raises(ValueError, match="batch"):
        group_advantages(torch.zeros(4), 2, norm="batch")


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)


def test_clip_advantages():
    assert torch.equal(clip_advantages(torch.tensor([-9.0, 0.5, 9.0]), 5.0), torch.tensor([-5.0, 0.5, 5.0]))


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
