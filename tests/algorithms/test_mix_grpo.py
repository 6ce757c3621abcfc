"""MixGRPO's sliding SDE window on hand-computed schedules."""

import pytest

from omni.algorithms.mix_grpo import MixGRPO, sliding_window
from omni.context import StepContext
from omni.validation import validate
from tests.conftest import compose_config


@pytest.mark.parametrize(
    "step,available,expected",
    [
        (0, 10, (0, 4)),
        (9, 10, (0, 4)),
        (10, 10, (1, 5)),
        (35, 10, (3, 7)),
        (65, 10, (6, 10)),
        (500, 10, (6, 10)),
        (500, 9, (5, 9)),
    ],
)
def test_window_slides_then_stays(step, available, expected):
    """size 4, stride 1, every 10 steps: start = min(step // 10, available - 4)."""
    assert sliding_window(step, 4, 1, 10, available) == expected


def test_algorithm_samples_its_window_and_cps_ends_it_before_sigma_zero(tmp_path):
    for sde_type, last in (("sde", (6, 10)), ("cps", (5, 9))):
        cfg = validate(
            compose_config(
                ["algorithm=mix_grpo", f"rollout.sde_type={sde_type}", "algorithm.window_stride=2"], tmp_path
            )
        )
        algorithm = MixGRPO(StepContext(cfg, None, [], [], None))
        assert algorithm.window(0) == (0, 4) and algorithm.window(10) == (2, 6) and algorithm.window(1000) == last
