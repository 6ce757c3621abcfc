"""Schema of the `reward` group: named reward functions and their weights."""

from dataclasses import dataclass
from typing import Dict

from omegaconf import MISSING


@dataclass
class RewardConfig:
    # name -> weight; the reward of an image is the weighted sum.
    weights: Dict[str, float] = MISSING
    # Images scored per call.
    batch_size: int = 64
