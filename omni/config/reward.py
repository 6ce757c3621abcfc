"""Schema of the `reward` group: the reward components and how they are combined.

`components` maps a reward's name (a module of omni/rewards/) to its options; each reward
types its own options (`omni.rewards.base.RewardOptions` and subclasses: weight, batch
size, device, ...), checked at validation. The reward of an image is the weighted sum;
`aggregation` says whether the advantages of a grouped rollout are those of that sum, or
the weighted sum of each reward's own group advantages (GDPO, omni/algorithms/advantages.py).
With `overlap`, a rollout is scored part by part while it is sampled (omni.rewards.streaming).
"""

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict

from omegaconf import MISSING

from omni.config.errors import require


class Aggregation(str, Enum):
    """Where a grouped rollout's rewards are summed: before the group normalisation, or after."""

    weighted_sum = "weighted_sum"  # the advantages of sum_k w_k r_k
    # each reward normalised within its group, the weighted sum of those over the batch (GDPO)
    gdpo = "gdpo"


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
    # How the components make the advantages of a grouped rollout (see Aggregation); gdpo
    # needs two weighted components and an algorithm that samples groups (algorithm.group_size).
    aggregation: Aggregation = Aggregation.weighted_sum
    # A rollout is scored in parts of rollout.micro_batch_size images per worker: with
    # overlap, each part on a background thread while the next is sampled; without, after
    # the whole rollout. The scores are the same either way.
    overlap: bool = True

    def __post_init__(self) -> None:
        """The rules on this group's own fields (see RolloutConfig.__post_init__); each
        component's options are typed and checked by omni.validation."""
        require(bool(self.components), "reward.components is empty: name at least one reward")
        require(self.batch_size > 0, f"reward.batch_size={self.batch_size} must be positive")
