"""What a reward is: a component with typed options, a set-up and tear-down, scored in batches.

A reward lives in `omni/rewards/<name>.py` and defines `REWARD`, a `Reward` subclass whose
`Options` dataclass (a subclass of `RewardOptions`) types its entry under
`reward.components.<name>`: a misspelt or mistyped option fails at validation, naming it.
`setup()` loads what the reward needs (a model, a connection) once, before training;
`score` maps a batch of images (B, 3, H, W in [0, 1]) and their prompts to one float each;
a video reward (`video = True`) maps clips (B, F, 3, H, W) instead. A reward that measures
more than it rewards (GenEval's 0/1 accuracy beside a dense share of requirements met)
overrides `score_details` instead, whose details are logged as reward/<name>/<detail>.

Prompts are `omni.data.prompts.Prompt` strings: each carries its item's `metadata` (a
dict, e.g. GenEval's objects) and its `origin` (file and line), so what a reward needs
beyond the text reaches `score` with no other argument. Two class-level checks run at
validation, before any model loads: `check_options` (paths that must exist) and
`prompt_problem` (what a prompt lacks for this reward). A reward that cannot score at all
(a server that stays unreachable) raises `RewardUnavailable`; it never returns zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch


@dataclass
class RewardOptions:
    # Weight of this component in the reward (the weighted sum over components).
    weight: float = 1.0
    # Images per `score` call; None: reward.batch_size.
    batch_size: Optional[int] = None


class RewardUnavailable(RuntimeError):
    """The reward could not score (its message names the reward and what failed)."""


class Reward:
    Options = RewardOptions
    # Whether `score` takes clips (B, F, 3, H, W), for a video model, instead of images.
    video: bool = False

    def __init__(self, name: str, options: RewardOptions):
        self.name, self.options = name, options

    @property
    def metric(self) -> str:
        """The name its scores are logged under (`reward/<metric>`, `eval/<metric>`): what it
        measures, which for most rewards is its own name."""
        return self.name

    @classmethod
    def check_options(cls, options: RewardOptions, key: str) -> None:
        """Raise ValueError naming `key.<option>` for options that cannot work (a missing file)."""

    @classmethod
    def prompt_problem(cls, options: RewardOptions, prompt: Any) -> Optional[str]:
        """What `prompt` (an `omni.data.prompts.Prompt`) lacks for this reward, or None."""
        return None

    def setup(self) -> None:
        """Load models or open connections; called once before the first `score`."""

    def teardown(self) -> None:
        """Release what `setup` took."""

    def score(self, images: torch.Tensor, prompts: List[str]) -> torch.Tensor:
        raise NotImplementedError

    def score_details(self, images: torch.Tensor, prompts: List[str]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """`score`, and other per-image measures by name (logged, not rewarded)."""
        return self.score(images, prompts), {}

    def source(self) -> str:
        """Where the scores come from, for messages about them ("" in process; a server's URL)."""
        return ""
