"""Schema of the `reward` group: the reward components and how they are combined.

`components` maps a reward's name (a module of omni/rewards/) to its options; each reward
types its own options (`omni.rewards.base.RewardOptions` and subclasses: weight, batch
size, device, ...), checked at validation. The reward of an image is the weighted sum.
"""

from dataclasses import dataclass
from typing import Any, Dict

from omegaconf import MISSING


@dataclass
class RewardConfig:
    components: Dict[str, Any] = MISSING
    # Images per scoring call, for components that do not set their own.
    batch_size: int = 64
