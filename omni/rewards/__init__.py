"""Reward functions: each maps a batch of images (B, 3, H, W in [0, 1]) and their prompts to
one float per image. `build_reward` combines the configured ones into a weighted sum."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from omni.rewards.brightness import brightness
from omni.rewards.color import color
from omni.rewards.jpeg import jpeg_compressibility

RewardFn = Callable[[torch.Tensor, List[str]], torch.Tensor]

REWARDS: Dict[str, RewardFn] = {
    "brightness": brightness,
    "color": color,
    "jpeg_compressibility": jpeg_compressibility,
}


def check_reward_names(weights: Dict[str, float], key: str = "reward.weights") -> None:
    if not weights:
        raise ValueError(f"{key} is empty: name at least one reward, one of {sorted(REWARDS)}")
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise ValueError(f"{key}: unknown reward {unknown}; available: {sorted(REWARDS)}")


class WeightedReward:
    """The weighted sum of named rewards, scored in chunks of `batch_size` images."""

    def __init__(self, weights: Dict[str, float], batch_size: int = 64):
        check_reward_names(weights)
        self.weights = dict(weights)
        self.batch_size = batch_size

    def __call__(self, images: torch.Tensor, prompts: List[str]) -> Dict[str, torch.Tensor]:
        """Returns {"reward": total, <name>: component} with one value per image."""
        parts = {name: [] for name in self.weights}
        for start in range(0, len(prompts), self.batch_size):
            chunk = images[start : start + self.batch_size].float().cpu()
            chunk_prompts = prompts[start : start + self.batch_size]
            for name in self.weights:
                parts[name].append(REWARDS[name](chunk, chunk_prompts).float())
        scores = {name: torch.cat(values) for name, values in parts.items()}
        scores["reward"] = sum(w * scores[name] for name, w in self.weights.items())
        return scores
