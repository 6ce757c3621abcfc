"""Schema of the `reward` group: the reward components and how they are combined.

`components` maps a reward's name (a module of omni/rewards/) to its options; each reward
types its own options (`omni.rewards.base.RewardOptions` and subclasses: weight, batch
size, device, ...), checked at validation. The reward of an image is the weighted sum.
With `overlap`, a rollout is scored part by part while it is sampled (omni.rewards.streaming).
"""

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict

from omegaconf import MISSING

from omni.config.errors import require


class NonFinite(str, Enum):
    fail = "fail"  # a NaN or inf reward stops the step, naming the reward, step and count
    drop = "drop"  # such images are left out of the update and counted (reward/dropped_nonfinite)


@dataclass
class RewardConfig:
    components: Dict[str, Any] = MISSING
    # Images per scoring call, for components that do not set their own.
    batch_size: int = 64
    # What a NaN or inf reward does.
    nonfinite: NonFinite = NonFinite.fail
    # A rollout is scored in parts of rollout.micro_batch_size images per worker: with
    # overlap, each part on a background thread while the next is sampled; without, after
    # the whole rollout. The scores are the same either way.
    overlap: bool = True

    def __post_init__(self) -> None:
        """The rules on this group's own fields (see RolloutConfig.__post_init__); each
        component's options are typed and checked by omni.validation."""
        require(bool(self.components), "reward.components is empty: name at least one reward")
        require(self.batch_size > 0, f"reward.batch_size={self.batch_size} must be positive")
