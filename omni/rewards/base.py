"""What a reward is: a component with typed options, a set-up and tear-down, scored in batches.

A reward lives in `omni/rewards/<name>.py` and defines `REWARD`, a `Reward` subclass whose
`Options` dataclass (a subclass of `RewardOptions`) types its entry under
`reward.components.<name>`: a misspelt or mistyped option fails at validation, naming it.
`setup()` loads what the reward needs (a model, a connection) once, before training;
`score` maps a batch of images (B, 3, H, W in [0, 1]) and their prompts to one float each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class RewardOptions:
    # Weight of this component in the reward (the weighted sum over components).
    weight: float = 1.0
    # Images per `score` call; None: reward.batch_size.
    batch_size: Optional[int] = None


class Reward:
    Options = RewardOptions

    def __init__(self, name: str, options: RewardOptions):
        self.name, self.options = name, options

    def setup(self) -> None:
        """Load models or open connections; called once before the first `score`."""

    def teardown(self) -> None:
        """Release what `setup` took."""

    def score(self, images: torch.Tensor, prompts: List[str]) -> torch.Tensor:
        raise NotImplementedError
