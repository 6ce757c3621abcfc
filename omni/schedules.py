"""Learning-rate schedules: the factor on `trainer.lr` for each training step.

The rate is a function of the step alone (like everything else in a run), so a resumed run
continues on the same curve with nothing saved. With `warmup_steps` = w, steps 0..w-1 ramp
up linearly to the full rate (step s gets (s + 1) / (w + 1)); the remaining steps follow the
schedule from 1 down towards 0 (never reaching it: the last step still learns):
constant stays at 1, linear falls in a straight line, cosine along half a cosine.
"""

from __future__ import annotations

import math


def lr_factor(step: int, steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """The factor on the base learning rate at training step `step` (0-based) of `steps`."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)  # in [0, 1)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"trainer.lr_schedule={schedule}: one of constant, linear, cosine")
