"""Diffusion-DPO for flow matching: sigma sampling, interpolation, target, loss and metrics."""

import math

import pytest
import torch

from omni.algorithms.dpo import (
    diffusion_dpo_loss,
    implicit_rewards,
    noisy_latents,
    per_sample_mse,
    sample_sigmas,
    velocity_target,
)


def _generator(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("mode", ["logit_normal", "uniform"])
def test_sigmas_lie_in_the_open_unit_interval_and_are_seeded(mode):
    sigmas = sample_sigmas(4096, mode, _generator(0))
    assert sigmas.shape == (4096,) and sigmas.dtype == torch.float32
    assert (sigmas > 0).all() and (sigmas < 1).all()
    assert torch.equal(sigmas, sample_sigmas(4096, mode, _generator(0)))
    assert not torch.equal(sigmas, sample_sigmas(4096, mode, _generator(1)))


def test_extreme_logit_normal_stays_inside_zero_one():
    sigmas = sample_sigmas(1000, "logit_normal", _generator(0), logit_mean=0.0, logit_std=100.0)
    assert (sigmas > 0).all() and (sigmas < 1).all()


def test_logit_normal_is_centred_on_sigmoid_of_its_mean():
    sigmas = sample_sigmas(20000, "logit_normal", _generator(0), logit_mean=1.0, logit_std=0.5)
    assert abs(sigmas.median().item() - 1 / (1 + math.exp(-1.0))) < 0.01
    uniform = sample_sigmas(20000, "uniform", _generator(0))
    assert abs(uniform.mean().item() - 0.5) < 0.01


def test_unknown_sigma_mode_is_named():
    with pytest.raises(ValueError, match="'cosine'"):
        sample_sigmas(3, "cosine")


def test_interpolation_and_velocity_target_hand_computed():
    x0 = torch.full((2, 1, 2, 2), 2.0)
    noise = torch.full((2, 1, 2, 2), -1.0)
    x_t = noisy_latents(x0, noise, torch.tensor([0.25, 1.0]))
    assert torch.allclose(x_t[0], torch.full((1, 2, 2), 0.75 * 2.0 + 0.25 * -1.0))
    assert torch.allclose(x_t[1], noise[1])  # sigma = 1 is pure noise
    assert torch.equal(velocity_target(x0, noise), torch.full((2, 1, 2, 2), -3.0))


def test_velocity_target_is_the_derivative_of_the_path():
    x0, noise = torch.randn(3, 4, 8, 8, generator=_generator(0)), torch.randn(3, 4, 8, 8, generator=_generator(1))
    sigmas, h = torch.tensor([0.1, 0.5, 0.9]), 1e-3
    slope = (noisy_latents(x0, noise, sigmas + h) - noisy_latents(x0, noise, sigmas)) / h
    assert torch.allclose(slope, velocity_target(x0, noise), atol=1e-3)


def test_shape_mismatches_are_errors():
    with pytest.raises(ValueError, match="differ in shape"):
        noisy_latents(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="one sigma per sample"):
        noisy_latents(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))


def test_per_sample_mse_hand_computed():
    pred = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]])
    target = torch.zeros(2, 2, 2)
    assert torch.allclose(per_sample_mse(pred, target), torch.tensor([30.0 / 4, 0.0]))


def test_loss_is_log_two_when_policy_equals_reference():
    errors = torch.rand(8, generator=_generator(0)), torch.rand(8, generator=_generator(1))
    out = diffusion_dpo_loss(errors[0], errors[1], errors[0].clone(), errors[1].clone(), beta=5000.0)
    assert abs(out["loss"].item() - math.log(2)) < 1e-6
    assert out["implicit_accuracy"].item() == 0.0  # no logit is strictly positive
    assert out["reward_margin"].item() == 0.0


def test_policy_better_on_chosen_hand_computed():
    # logit = -beta/2 * ((pc - rc) - (pr - rr)) = -1 * ((0.5 - 1) - (1 - 1)) = 0.5
    one = torch.ones(2)
    out = diffusion_dpo_loss(0.5 * one, one, one, one, beta=2.0)
    assert math.isclose(out["loss"].item(), math.log1p(math.exp(-0.5)), rel_tol=1e-6)
    assert out["loss"].item() < math.log(2)
    assert out["implicit_accuracy"].item() == 1.0
    assert math.isclose(out["reward_margin"].item(), 0.5, rel_tol=1e-6)
    assert math.isclose(out["reward_chosen"].item(), 0.5, rel_tol=1e-6)
    assert out["reward_rejected"].item() == 0.0
    assert out["policy_err_chosen"].item() == 0.5 and out["ref_err_rejected"].item() == 1.0


def test_mixed_pairs_accuracy_and_margin():
    # logit = -1/2 * ((pc - rc) - (pr - rr)): pair 1 -> -1/2 * -1 = 0.5, pair 2 -> -1/2 * 2 = -1
    pc, pr = torch.tensor([0.0, 3.0]), torch.tensor([1.0, 1.0])
    rc, rr = torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0])
    out = diffusion_dpo_loss(pc, pr, rc, rr, beta=1.0)
    expected = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.0))) / 2
    assert math.isclose(out["loss"].item(), expected, rel_tol=1e-6)
    assert out["implicit_accuracy"].item() == 0.5
    assert math.isclose(out["reward_margin"].item(), (0.5 - 1.0) / 2, rel_tol=1e-6)


def test_gradient_lowers_chosen_error_and_skips_reference():
    pc = torch.tensor([1.0, 2.0], requires_grad=True)
    pr = torch.tensor([1.0, 2.0], requires_grad=True)
    rc = torch.tensor([1.0, 2.0], requires_grad=True)
    out = diffusion_dpo_loss(pc, pr, rc, torch.tensor([1.0, 2.0]), beta=2.0)
    out["loss"].backward()
    assert (pc.grad > 0).all() and (pr.grad < 0).all()  # descent lowers pc and raises pr
    assert rc.grad is None
    assert not out["reward_margin"].requires_grad


def test_implicit_reward_sign():
    assert implicit_rewards(torch.tensor([0.5]), torch.tensor([1.0]), beta=4.0).item() == 1.0


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match="same shape"):
        diffusion_dpo_loss(torch.ones(2), torch.ones(3), torch.ones(2), torch.ones(2), beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        diffusion_dpo_loss(torch.ones(2), torch.ones(2), torch.ones(2), torch.ones(2), beta=0.0)
