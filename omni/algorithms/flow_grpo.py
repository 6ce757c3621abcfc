"""Flow-GRPO's objective as pure tensor functions: advantages, clipped ratio loss, KL.

GRPO needs no value network: each prompt is sampled `group_size` times and an image's
advantage is its reward standardised within its group (or by the batch's std). The policy
gradient is PPO's clipped importance-ratio loss, applied per denoising step, with an
optional KL between the policy's and the reference's Gaussian step distributions.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, global_std: bool = False, eps: float = 1e-4):
    """Rewards ordered group by group (group_size consecutive samples per prompt) ->
    advantages (r - mean of its group) / std (of its group, or of the whole batch)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    std = rewards.float().std() if global_std else grouped.std(dim=1, keepdim=True)
    return (centred / (std + eps)).reshape(-1)


def clip_advantages(advantages: torch.Tensor, max_abs: float) -> torch.Tensor:
    return advantages.clamp(-max_abs, max_abs)


def clipped_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float):
    """PPO's pessimistic surrogate, averaged over samples. Returns (loss, ratio, clip fraction)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    clip_fraction = ((ratio - 1).abs() > clip_range).float().mean()
    return loss, ratio, clip_fraction


def gaussian_step_kl(mean: torch.Tensor, ref_mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, s^2) || N(ref_mean, s^2)) per sample, averaged over latent elements
    (the two steps share the SDE's scale s)."""
    kl = (mean - ref_mean) ** 2 / (2 * scale**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))
