"""Group advantages: from a grouped rollout's rewards to one advantage per image, shared by
every algorithm that samples a group per prompt.

An image's advantage is its reward minus its group's mean, divided by the group's std, the
batch's std, or nothing (`algorithm.adv_norm`: group, global, or none as in Dr.GRPO, Liu et
al. 2025, "Understanding R1-Zero-Like Training").

With several rewards, `reward.aggregation` says where their weighted sum is taken:

- `weighted_sum`: before the normalisation. The advantage is that of r = sum_k w_k r_k, so
  the reward that varies most within a group decides the ranking, whatever the weights say.
- `gdpo` (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
  Multi-reward RL Optimization", arXiv:2601.05242): each reward is normalised within its
  group first, the weighted sum of those advantages is then normalised over the batch:

      A_k  = (r_k - mean_group(r_k)) / (std_group(r_k) + eps)         for each reward k
      A    = sum_k w_k A_k
      A^   = (A - mean_batch(A)) / (std_batch(A) + eps)

  so every reward moves the advantage as its weight says, on the scale of its own spread,
  and distinct combinations of the rewards keep distinct advantages. With adv_norm=global
  each A_k is divided by its reward's batch std instead of its group's.

Images whose reward is not finite (reward.nonfinite=drop) are left out of every mean and
std and get advantage 0.
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch

from omni.config.reward import Aggregation


def _norm_name(norm) -> str:
    """ "group", "global" or "none", from the config's enum or a plain string."""
    norm = getattr(norm, "value", norm)
    if norm not in ("group", "global", "none"):
        raise ValueError(f"advantage normalisation {norm!r}: expected group, global or none")
    return norm


def group_advantages(rewards: torch.Tensor, group_size: int, norm: str = "group", eps: float = 1e-4):
    """Rewards ordered group by group (group_size consecutive samples per prompt) ->
    advantages r - mean of its group, divided by the std of its group (norm "group", GRPO),
    of the whole batch ("global") or by nothing ("none", Dr.GRPO: the std division favours
    prompts whose images barely differ)."""
    norm = _norm_name(norm)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm == "none":
        return centred.reshape(-1)
    std = rewards.float().std() if norm == "global" else grouped.std(dim=1, keepdim=True)
    return (centred / (std + eps)).reshape(-1)


def masked_group_advantages(
    rewards: torch.Tensor, valid: torch.Tensor, group_size: int, norm: str = "group", eps: float = 1e-4
):
    """`group_advantages` over the valid rewards only; an invalid (non-finite) reward gets
    advantage 0, so its image takes no part in the update."""
    norm = _norm_name(norm)
    if valid.all():
        return group_advantages(rewards, group_size, norm, eps)
    mask = valid.reshape(-1, group_size)
    grouped = torch.where(mask, rewards.reshape(-1, group_size).float(), torch.zeros(()))
    count = mask.sum(dim=1, keepdim=True)
    centred = torch.where(mask, grouped - grouped.sum(dim=1, keepdim=True) / count.clamp(min=1), torch.zeros(()))
    if norm == "none":
        return centred.reshape(-1)
    if norm == "global":
        std = rewards[valid].float().std()
    else:
        std = ((centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return (centred / (std + eps)).reshape(-1)


def clip_advantages(advantages: torch.Tensor, max_abs: float) -> torch.Tensor:
    return advantages.clamp(-max_abs, max_abs)


def batch_normalised(values: torch.Tensor, valid: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(v - mean) / (std + eps) over the valid entries of the whole batch; 0 elsewhere."""
    kept = values[valid].float()
    if len(kept) < 2:  # no spread to measure: no signal
        return torch.zeros_like(values, dtype=torch.float32)
    # GDPO's sum is already centred (each reward is, within its group); the mean is taken
    # all the same, so that the function normalises whatever it is given
    normalised = (values.float() - kept.mean()) / (kept.std() + eps)
    return torch.where(valid, normalised, torch.zeros(()))


def gdpo_advantages(
    scores: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    valid: torch.Tensor,
    group_size: int,
    norm: str = "group",
    eps: float = 1e-4,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GDPO: each reward `scores[name]` normalised within its group, their sum weighted by
    `weights[name]`, normalised over the batch -> (advantages, each reward's own advantages)."""
    per_reward = {name: masked_group_advantages(scores[name], valid, group_size, norm, eps) for name in weights}
    total = sum(weight * per_reward[name] for name, weight in weights.items())
    return batch_normalised(total, valid, eps), per_reward


def aggregated_advantages(
    scores: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    valid: torch.Tensor,
    group_size: int,
    aggregation: str = "weighted_sum",
    adv_norm: str = "group",
    eps: float = 1e-4,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """A grouped rollout's advantages from its scores ("reward", the weighted sum, and each
    reward by name) and the rewards' weights by name, as `reward.aggregation` says ->
    (advantages, metrics: with gdpo, the std of each reward's own advantages over the batch,
    reward/<name>/advantage_std; near 0 when that reward no longer varies within groups)."""
    aggregation = Aggregation(getattr(aggregation, "value", aggregation))
    if aggregation == Aggregation.weighted_sum:
        return masked_group_advantages(scores["reward"], valid, group_size, adv_norm, eps), {}
    advantages, per_reward = gdpo_advantages(scores, weights, valid, group_size, adv_norm, eps)
    metrics = {
        f"reward/{name}/advantage_std": float(values[valid].std()) if valid.sum() > 1 else 0.0
        for name, values in per_reward.items()
    }
    return advantages, metrics
