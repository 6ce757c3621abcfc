"""scripts/bench_parity.py: the parity gate's cost, timed over one cadence of steps with and
without it, prints its settings and figures as JSON (on the tiny SD3, a small batch)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_parity_times_one_cadence_with_one_check(tiny_cache):
    overrides = [f"model.cache_dir={tiny_cache}", "trainer.batch_size=4", "algorithm.group_size=2"]
    out = subprocess.run(
        [sys.executable, "scripts/bench_parity.py", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    result = json.loads(out)
    assert result["settings"]["images_per_step"] == 4 and result["settings"]["every"] == 10
    assert result["settings"]["timed_steps"] == 10 and result["gate_checks_timed"] == 1
    assert 0 < result["seconds_per_check"] < result["seconds_per_step_with_gate"] * 10
    assert result["ratio"] > 0 and result["amortised_cost_at_default_cadence"] == pytest.approx(
        result["check_over_step"] / 10
    )
