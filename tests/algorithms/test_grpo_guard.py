"""GRPO-Guard's regulated ratio on hand-computed steps, and its update on the tiny SD3."""

import math

import torch

from omni.algorithms import grpo_guard
from omni.algorithms.flow_grpo import OldSteps, ScoredSteps
from omni.rollout.sde import gaussian_log_prob

# One sample, two latent elements: the rollout step N(mu_old = 0, s = 0.5) drew eps = (1, 2),
# x' = (0.5, 1.0); the policy's mean moved to mu = (0.1, -0.2).
OLD_MEAN, MEAN, SCALE = torch.zeros(1, 2), torch.tensor([[0.1, -0.2]]), torch.tensor(0.5)
NEXT = OLD_MEAN + SCALE * torch.tensor([[1.0, 2.0]])


def log_probs():
    return gaussian_log_prob(NEXT, MEAN, SCALE), gaussian_log_prob(NEXT, OLD_MEAN, SCALE)


def test_raw_log_ratio_is_biased_and_the_guard_removes_the_bias():
    """log r = -mean[(x' - mu)^2 - (x' - mu_old)^2] / (2 s^2) = -mean[0.16 - 0.25, 1.44 - 1.0] / 0.5
    = -0.35; the bias mean|mu - mu_old|^2 / (2 s^2) = 0.025 / 0.5 = 0.05, so the centred
    log-ratio is -0.30 = -mean(eps (mu_old - mu)) / s; times s = 0.5: -0.15."""
    new, old = log_probs()
    assert math.isclose((new - old).item(), -0.35, rel_tol=1e-5)
    centred = grpo_guard.centred_log_ratio(new, old, MEAN, OLD_MEAN, SCALE)
    assert math.isclose(centred.item(), -0.30, rel_tol=1e-5)
    guarded = grpo_guard.guarded_log_ratio(new, old, MEAN, OLD_MEAN, SCALE)
    assert math.isclose(guarded.item(), -0.15, rel_tol=1e-5)


def test_guarded_ratio_is_centred_on_one_at_every_noise_level():
    """Over many draws of the rollout's noise, the raw ratio's log is biased below 0 by
    |mu - mu_old|^2 / (2 s^2), most at small s; the guarded one is centred at every s and
    its spread does not depend on s."""
    generator = torch.Generator().manual_seed(0)
    delta = torch.full((1, 64), 0.05)
    spreads = []
    for s in (0.05, 0.5):
        eps = torch.randn(4000, 64, generator=generator)
        next_sample = s * eps
        new, old = (
            gaussian_log_prob(next_sample, delta, torch.tensor(s)),
            gaussian_log_prob(next_sample, torch.zeros(1, 64), torch.tensor(s)),
        )
        assert math.isclose(float((new - old).mean()), -(0.05**2) / (2 * s**2), rel_tol=0.1)
        guarded = grpo_guard.guarded_log_ratio(new, old, delta.expand(4000, 64), torch.zeros(4000, 64), torch.tensor(s))
        assert abs(float(guarded.mean())) < 3 * float(guarded.std()) / math.sqrt(4000)
        spreads.append(float(guarded.std()))
    assert math.isclose(spreads[0], spreads[1], rel_tol=0.1)


def test_guard_loss_is_the_clipped_loss_of_the_guarded_ratio():
    new, old = log_probs()
    policy = ScoredSteps(new, MEAN, SCALE, torch.zeros(1, 2))
    algo = type("Algo", (), {"clip_range": 0.1})()
    for advantage, expected in ((1.0, -math.exp(-0.15)), (-1.0, 0.9)):  # A > 0: unclipped r; A < 0: max(r, 0.9)
        loss, metrics = grpo_guard.guard_loss(policy, OldSteps(old, torch.tensor([advantage]), OLD_MEAN), algo)
        assert math.isclose(loss.item(), expected, rel_tol=1e-5), advantage
    assert math.isclose(metrics["raw_ratio"].item(), math.exp(-0.35), rel_tol=1e-5)


def test_update_on_the_tiny_model_raises_positive_advantage_log_prob(fresh):
    from tests.algorithms.test_flow_grpo_update import all_log_probs, rollout

    batch = rollout(fresh, n=2)
    before = all_log_probs(fresh, batch).mean(dim=1)
    metrics = fresh.apply_update(grpo_guard.update, grpo_guard.GRPOBatch(batch, torch.tensor([1.0, -1.0])), seed=0)
    after = all_log_probs(fresh, batch).mean(dim=1)
    assert after[0] > before[0] and after[1] < before[1], (before, after)
    assert metrics["grad_norm"] > 0 and "raw_ratio" in metrics
