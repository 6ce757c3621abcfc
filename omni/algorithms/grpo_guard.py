"""GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow
Matching via Regulated Clipping", arXiv:2510.22319): Flow-GRPO with its importance ratio
regulated at each denoising step.

A stored step x' = mu_old + s eps, re-scored by a policy whose step mean moved to mu, has
the log-ratio (Gaussian log-densities, averaged over the latent's elements)

    log r = log p(x') - log p_old(x') = -mean |mu - mu_old|^2 / (2 s^2) - mean <eps, mu_old - mu> / s

Its mean, -|mu - mu_old|^2 / (2 s^2), is below 0: the ratio is biased below 1, the more so at
low-noise steps (small s), so the clip stops positive-advantage samples late and negative
ones early. Its spread grows as 1/s, so low-noise steps dominate the gradient. GRPO-Guard's
two corrections, per step:

- ratio normalisation: add the bias back, |mu - mu_old|^2 / (2 s^2), so the log-ratio is
  centred on 0 (the ratio on 1) at every step;
- gradient reweighting: multiply the centred log-ratio by s, so every step's log-ratio,
  -mean <eps, mu_old - mu>, has the same scale whatever its noise level.

    log r_guard = s (log p - log p_old) + mean |mu - mu_old|^2 / (2 s)

and PPO's clipped loss takes r_guard in place of r. mu_old, the rollout policy's step mean,
is recomputed on the worker before the first optimizer step (`rollout_step_means`). It holds
for any Gaussian step whose scale does not depend on the weights: `rollout.sde_type` sde or cps.

    python recipes/train.py algorithm=grpo_guard
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from omni.algorithms.flow_grpo import FlowGRPO, GRPOBatch, OldSteps, ScoredSteps, clipped_policy_loss, run_update


def per_sample(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A step's scale (a scalar, or one per sample broadcastable over the latent) -> (n,)."""
    scale = torch.as_tensor(scale).flatten()
    return scale.expand(n) if scale.numel() == 1 else scale


def centred_log_ratio(log_prob, old_log_prob, mean, old_mean, scale) -> torch.Tensor:
    """Ratio normalisation: log p - log p_old + mean |mu - mu_old|^2 / (2 s^2), per sample."""
    s = per_sample(scale, len(log_prob))
    mse = ((mean - old_mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return log_prob - old_log_prob + mse / (2 * s**2)


def guarded_log_ratio(log_prob, old_log_prob, mean, old_mean, scale) -> torch.Tensor:
    """Ratio normalisation, then the gradient reweighting: s times the centred log-ratio."""
    return per_sample(scale, len(log_prob)) * centred_log_ratio(log_prob, old_log_prob, mean, old_mean, scale)


def guard_loss(policy: ScoredSteps, old: OldSteps, algo) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO's clipped loss on the guarded ratio -> (loss, metrics)."""
    log_ratio = guarded_log_ratio(policy.log_prob, old.log_prob, policy.mean, old.mean, policy.scale)
    loss, ratio, clip_fraction = clipped_policy_loss(
        log_ratio, torch.zeros_like(log_ratio), old.advantages, algo.clip_range
    )
    raw_ratio = torch.exp(policy.log_prob - old.log_prob).mean()
    return loss, {"clip_fraction": clip_fraction, "ratio": ratio.mean(), "raw_ratio": raw_ratio}


def update(worker, batch: GRPOBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """GRPO-Guard's update on a worker: Flow-GRPO's, with the guarded ratio."""
    return run_update(worker, batch, seed, first, guard_loss, needs_old_means=True)


class GRPOGuard(FlowGRPO):
    """Flow-GRPO's step and checks; the update regulates the ratio per denoising step."""

    supports_async = False  # its loss reads the rollout's step means under the current weights

    update = staticmethod(update)


ALGORITHM = GRPOGuard
