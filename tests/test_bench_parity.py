"""scripts/bench_parity.py: the parity gate's cost, timed over one cadence of steps with and
without it, prints its settings and figures as JSON (on the tiny SD3, a small batch, and a
cadence of 3 steps instead of the default 10, for time)."""

import json

import pytest

from tests import cli_process


@pytest.mark.slow
def test_bench_parity_times_one_cadence_with_one_check(tiny_cache):
    overrides = [
        f"model.cache_dir={tiny_cache}",
        "trainer.batch_size=4",
        "algorithm.group_size=2",
        "rollout.parity.every=3",
    ]
    run = cli_process.run(["scripts/bench_parity.py", *overrides], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["settings"]["images_per_step"] == 4 and result["settings"]["every"] == 3
    assert result["settings"]["timed_steps"] == 3 and result["gate_checks_timed"] == 1
    assert 0 < result["seconds_per_check"] < result["seconds_per_step_with_gate"] * 3
    assert result["ratio"] > 0 and result["amortised_cost_at_this_cadence"] == pytest.approx(
        result["check_over_step"] / 3
    )
