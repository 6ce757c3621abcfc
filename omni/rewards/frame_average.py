"""An image reward scored on every frame of a clip and averaged over the frames.

`reward.components.frame_average.image` names any image reward (a module of omni/rewards/)
and `image_options` holds its options, typed and checked as that reward's own at
validation; the clip's score is the mean of its frames' scores, each frame scored with the
clip's prompt. Its scores are logged as `frame_<image>` (`reward=frame_brightness` logs
`reward/frame_brightness`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING

from omni.rewards.base import Reward, RewardOptions


@dataclass
class FrameAverageOptions(RewardOptions):
    # The image reward scored on each frame, and its options.
    image: str = MISSING
    image_options: Dict[str, Any] = field(default_factory=dict)


def image_reward(options: FrameAverageOptions, key: str):
    """The image reward's class and typed options; ValueError naming `key` when it is unknown,
    itself a video reward, or its options do not type."""
    from omni.rewards import REWARDS, reward_options

    try:
        cls = REWARDS.get(options.image)
    except KeyError:
        raise ValueError(f"{key}.image={options.image}: no such reward; available: {REWARDS.names()}") from None
    if cls.video:
        raise ValueError(f"{key}.image={options.image} scores videos; name an image reward")
    return cls, reward_options(options.image, options.image_options, f"{key}.image_options")


class FrameAverage(Reward):
    Options = FrameAverageOptions
    video = True

    def __init__(self, name: str, options: FrameAverageOptions):
        super().__init__(name, options)
        cls, inner = image_reward(options, f"reward.components.{name}")
        self.inner = cls(options.image, inner)

    @property
    def metric(self) -> str:
        return f"frame_{self.options.image}"

    @classmethod
    def check_options(cls, options: FrameAverageOptions, key: str) -> None:
        inner_cls, inner = image_reward(options, key)
        inner_cls.check_options(inner, f"{key}.image_options")

    @classmethod
    def prompt_problem(cls, options: FrameAverageOptions, prompt: Any) -> Optional[str]:
        inner_cls, inner = image_reward(options, "reward.components.frame_average")
        return inner_cls.prompt_problem(inner, prompt)

    def setup(self) -> None:
        self.inner.setup()

    def teardown(self) -> None:
        self.inner.teardown()

    def score(self, clips: torch.Tensor, prompts) -> torch.Tensor:
        """Clips (B, F, 3, H, W) -> the mean of their frames' image rewards (B,)."""
        b, f = clips.shape[:2]
        frame_prompts = [p for p in prompts for _ in range(f)]
        return self.inner.score(clips.reshape(b * f, *clips.shape[2:]), frame_prompts).float().reshape(b, f).mean(1)


REWARD = FrameAverage
