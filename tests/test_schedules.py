"""The learning-rate schedules: warm-up ramps up to the full rate, then each schedule's shape."""

import math

import pytest

from omni.schedules import lr_factor


def test_warmup_ramps_up_then_each_schedule_decays_its_way():
    steps, warmup = 10, 3
    for schedule in ("constant", "linear", "cosine"):
        factors = [lr_factor(s, steps, schedule, warmup) for s in range(steps)]
        assert factors[:warmup] == [0.25, 0.5, 0.75], schedule  # no step at rate 0
        assert factors[warmup] == 1.0 and factors[-1] > 0, schedule
    assert [lr_factor(s, steps, "constant", warmup) for s in range(warmup, steps)] == [1.0] * (steps - warmup)
    linear = [lr_factor(s, steps, "linear", warmup) for s in range(warmup, steps)]
    assert linear == pytest.approx([1 - k / 7 for k in range(7)])
    cosine = [lr_factor(s, steps, "cosine", warmup) for s in range(warmup, steps)]
    assert cosine == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(7)])
    assert all(a > b for a, b in zip(cosine, cosine[1:]))


def test_no_warmup_starts_at_the_full_rate():
    assert lr_factor(0, 5, "cosine") == 1.0 and lr_factor(0, 5, "linear") == 1.0
    with pytest.raises(ValueError, match="trainer.lr_schedule=step"):
        lr_factor(3, 5, "step")
