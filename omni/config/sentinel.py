"""Schema of `sentinel`: the reward-hacking sentinel (omni/sentinel.py), run at each evaluation.

At every evaluation the sentinel measures the held-out images beyond the training reward:
image statistics (`Statistic`) and `gold` rewards, scored but never trained on. Its rules
compare each evaluation with the base evaluation (the first, before training): the `gold`
rule fires when the training reward rose while a gold reward fell by more than
`gold_drop_se` standard errors, the `statistic` rule when a watched statistic moved more
than `stat_shift_sd` of the base images' standard deviations. A rule that fires takes
`action`. Everything measured is logged under sentinel/.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omni.config.errors import require


class Statistic(str, Enum):
    brightness = "brightness"  # mean luma (Rec. 601)
    saturation = "saturation"  # mean HSV saturation
    color_entropy = "color_entropy"  # bits, of the colours quantised to 4 levels a channel (at most 6)
    dark_fraction = "dark_fraction"  # share of pixels with luma below 0.1
    edge_density = "edge_density"  # share of pixels whose luma gradient exceeds 0.1
    latent_norm = "latent_norm"  # root mean square of the final latent


class SentinelAction(str, Enum):
    warn = "warn"  # log the rule, the step and the figures; train on
    stop = "stop"  # stop the run (the last checkpoint is kept)
    # reload the newest checkpoint saved at an evaluation where no rule fired, multiply the
    # learning rate by `lr_factor` and train on from there; stop when there is none, or after
    # `max_rollbacks` rollbacks
    rollback = "rollback"


@dataclass
class SentinelConfig:
    # Off by default: it scores the gold rewards and the statistics on every evaluation.
    enabled: bool = False
    # Rewards scored on each evaluation's images and never trained on: reward name ->
    # options, as in reward.components (typed at validation; their weights are not used).
    gold: Dict[str, Any] = field(default_factory=dict)
    # The gold rule: training reward up while a gold reward is down by more than this many
    # standard errors of its paired change (same prompts and seeds); null: off.
    gold_drop_se: Optional[float] = 3.0
    # The statistic rule: a watched statistic's mean moved by more than this many standard
    # deviations of the base evaluation's images; null: off.
    stat_shift_sd: Optional[float] = None
    # The statistics the statistic rule watches (every statistic is measured and logged).
    watch: List[Statistic] = field(default_factory=lambda: list(Statistic))
    action: SentinelAction = SentinelAction.warn
    # rollback: the learning rate's factor after each rollback
    lr_factor: float = 0.5
    # rollback: how many rollbacks a run may make; the next firing stops it
    max_rollbacks: int = 2

    def __post_init__(self) -> None:
        """The rules on this group's own fields (see RolloutConfig.__post_init__); the gold
        rewards' options and the rules with the trainer's cadences are omni.validation's."""
        require(
            self.gold_drop_se is None or self.gold_drop_se > 0,
            f"sentinel.gold_drop_se={self.gold_drop_se} must be positive (standard errors), or null for no gold rule",
        )
        require(
            self.stat_shift_sd is None or self.stat_shift_sd > 0,
            f"sentinel.stat_shift_sd={self.stat_shift_sd} must be positive (standard deviations), "
            "or null for no statistic rule",
        )
        require(
            self.stat_shift_sd is None or len(self.watch) > 0,
            f"sentinel.watch is empty but sentinel.stat_shift_sd={self.stat_shift_sd}: "
            f"name the statistics to watch, some of {[s.value for s in Statistic]}",
        )
        require(0 < self.lr_factor <= 1, f"sentinel.lr_factor={self.lr_factor} must be in (0, 1]")
        require(self.max_rollbacks >= 0, f"sentinel.max_rollbacks={self.max_rollbacks} must be >= 0")
