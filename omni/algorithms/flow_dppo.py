"""Flow-DPPO ("Divergence Proximal Policy Optimization for Flow Matching Models",
arXiv:2606.11025): Flow-GRPO with a trust region on the divergence of each denoising step
in place of PPO's ratio clipping.

A single sample's ratio is a noisy estimate of how far the policy moved; each step of a
flow model is Gaussian, so the divergence itself is exact and cheap. For the step of the
current policy (mean mu) and of the rollout policy (mu_old), sharing the scale s,

    KL = mean |mu - mu_old|^2 / (2 s^2)          (averaged over the latent's elements)

and the loss is the plain policy gradient with a mask M:

    loss = -mean(A r M),   M = 0 where KL > delta and the step would move further the way
                           the advantage pushes it (r > 1 with A > 0, or r < 1 with A < 0), else 1

so a transition outside the trust region stops pulling the policy away, but still pulls it
back. delta is `algorithm.kl_mask_threshold`. mu_old is recomputed on the worker before the
first optimizer step (`rollout_step_means`).

    python recipes/train.py algorithm=flow_dppo
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from omni.algorithms.flow_grpo import (
    FlowGRPO,
    GroupPolicyConfig,
    GRPOBatch,
    OldSteps,
    ScoredSteps,
    check_policy_config,
    gaussian_step_kl,
    run_update,
)
from omni.config.errors import require


def trust_region_mask(
    ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor, threshold: float
) -> torch.Tensor:
    """1 for the transitions that keep their gradient, 0 for those outside the trust region
    moving further out (a constant: no gradient flows through the mask)."""
    moving_out = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    return (~((kl > threshold) & moving_out)).to(ratio.dtype).detach()


def dppo_policy_loss(log_prob, old_log_prob, advantages, kl, threshold: float):
    """-mean(A r M) -> (loss, ratio, fraction masked)."""
    ratio = torch.exp(log_prob - old_log_prob)
    mask = trust_region_mask(ratio.detach(), advantages, kl.detach(), threshold)
    return -(advantages * ratio * mask).mean(), ratio, 1 - mask.mean()


def dppo_loss(policy: ScoredSteps, old: OldSteps, algo) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    kl = gaussian_step_kl(policy.mean, old.mean, policy.scale)
    loss, ratio, masked = dppo_policy_loss(policy.log_prob, old.log_prob, old.advantages, kl, algo.kl_mask_threshold)
    return loss, {"mask_fraction": masked, "ratio": ratio.mean(), "kl_old": kl.mean()}


@dataclass
class FlowDPPOConfig(GroupPolicyConfig):
    """Flow-DPPO: a trust region on the Gaussian KL of each step instead of ratio clipping."""

    # A transition whose KL(current step || rollout step), averaged over the latent, exceeds
    # this stops contributing once its ratio moves further in its advantage's direction.
    kl_mask_threshold: float = 1e-6


def update(worker, batch: GRPOBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """Flow-DPPO's update on a worker: Flow-GRPO's, with the trust-region mask."""
    return run_update(worker, batch, seed, first, dppo_loss, needs_old_means=True)


class FlowDPPO(FlowGRPO):
    """Flow-GRPO's step; the update masks by the steps' divergence instead of clipping."""

    Options = FlowDPPOConfig  # its options: schema/algorithm/flow_dppo
    supports_async = False  # its loss reads the rollout's step means under the current weights

    update = staticmethod(update)

    @classmethod
    def check_config(cls, cfg) -> None:
        threshold = cfg.algorithm.kl_mask_threshold
        require(threshold > 0, f"algorithm.kl_mask_threshold={threshold} must be positive")
        check_policy_config(cfg)


ALGORITHM = FlowDPPO
