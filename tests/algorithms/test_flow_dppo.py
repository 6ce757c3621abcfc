"""Flow-DPPO's trust-region mask and loss on hand-computed cases, and its update."""

import math

import torch

from omni.algorithms import flow_dppo


def test_mask_and_loss_hand_computed():
    """Ratios (1.5, 0.5, 1.2, 0.8), advantages (1, -1, -1, 1), KL (0.1, 0.1, 0.1, 1e-9),
    delta 0.01: samples 1 and 2 are outside the region and moving further out -> masked;
    sample 3 is outside but moving back (r > 1, A < 0) and sample 4 inside -> kept.
    loss = -(0 + 0 + (-1)(1.2) + (1)(0.8)) / 4 = 0.1."""
    ratio = torch.tensor([1.5, 0.5, 1.2, 0.8])
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    kl = torch.tensor([0.1, 0.1, 0.1, 1e-9])
    assert torch.equal(flow_dppo.trust_region_mask(ratio, advantages, kl, 0.01), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    log_prob = torch.log(ratio).requires_grad_()
    loss, _, masked = flow_dppo.dppo_policy_loss(log_prob, torch.zeros(4), advantages, kl, 0.01)
    assert math.isclose(loss.item(), 0.1, rel_tol=1e-6) and masked.item() == 0.5
    loss.backward()
    # d loss / d log_prob_i = -A_i r_i M_i / 4
    assert torch.allclose(log_prob.grad, torch.tensor([0.0, 0.0, 1.2 / 4, -0.8 / 4]))


def test_inside_the_region_it_is_the_plain_policy_gradient():
    ratio = torch.tensor([1.5, 0.5])
    advantages = torch.tensor([1.0, -1.0])
    loss, _, masked = flow_dppo.dppo_policy_loss(torch.log(ratio), torch.zeros(2), advantages, torch.zeros(2), 0.01)
    assert math.isclose(loss.item(), -(1.5 - 0.5) / 2, rel_tol=1e-6) and masked.item() == 0


def test_update_on_the_tiny_model_raises_positive_advantage_log_prob(fresh, monkeypatch):
    from dataclasses import asdict, fields

    from omni.algorithms.flow_dppo import FlowDPPOConfig
    from tests.algorithms.test_flow_grpo_update import all_log_probs, rollout

    shared = {k: v for k, v in asdict(fresh.cfg.algorithm).items() if k in {f.name for f in fields(FlowDPPOConfig)}}
    monkeypatch.setattr(fresh.cfg, "algorithm", FlowDPPOConfig(**{**shared, "name": "flow_dppo"}))
    batch = rollout(fresh, n=2)
    before = all_log_probs(fresh, batch).mean(dim=1)
    metrics = fresh.apply_update(flow_dppo.update, flow_dppo.GRPOBatch(batch, torch.tensor([1.0, -1.0])), seed=0)
    after = all_log_probs(fresh, batch).mean(dim=1)
    assert after[0] > before[0] and after[0] - before[0] > after[1] - before[1], (before, after)
    # the second minibatch runs on moved weights: some of its transitions leave the region
    assert 0 < metrics["mask_fraction"] < 1 and metrics["kl_old"] > 1e-6
