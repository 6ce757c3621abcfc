"""scripts/compare_algorithms.py: the paired gain of a chosen held-out score, the time to a
given rise, and one real comparison run on the scenes task (micro SD3, scene accuracy)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_modules import load_script

REPO = Path(__file__).resolve().parents[1]


def script():
    return load_script("compare_algorithms")


def test_the_paired_gain_is_of_the_chosen_score_and_skips_non_finite_images():
    summary = {
        "before": [9.0, 9.0, 9.0],
        "after": [9.0, 9.0, 9.0],
        "scores": {"acc": {"before": [0.0, 1.0, 0.0, None, 0.0], "after": [1.0, 1.0, 1.0, 1.0, 0.0]}},
    }
    result = script().paired_gain(summary, "acc")
    # gains 1, 0, 1, 0 (the None image left out): mean 0.5, std 0.57735, t = 0.5 / (0.57735 / 2)
    assert result["n"] == 4 and result["gain"] == pytest.approx(0.5)
    assert result["t"] == pytest.approx(0.5 / (0.5773503 / 2), rel=1e-5)


def test_time_to_reach_is_the_first_evaluation_that_far_above_the_start():
    time_to_reach = script().time_to_reach
    curve = [{"reward": 0.2, "wall_s": 0.0}, {"reward": 0.29, "wall_s": 10.0}, {"reward": 0.31, "wall_s": 20.0}]
    assert time_to_reach(curve, 0.1) == 20.0
    assert time_to_reach(curve, 0.2) is None
    assert time_to_reach([], 0.1) is None


def test_an_evaluation_is_read_from_the_logged_console_line():
    evaluation_in = script().evaluation_in
    line = "[2026-01-01 00:00:00,000][omni.loggers][INFO] - step 7: eval/reward=0.5 eval/acc=0.25 eval/acc/colors=0"
    assert evaluation_in(line, "acc") == (7, 0.25)
    assert evaluation_in("step 3: eval/acc=1 train/loss=2", "acc") == (3, 1.0)
    assert evaluation_in("step 3: train/loss=2 reward/acc=1", "acc") is None
    assert evaluation_in("eval/acc=1", "acc") is None


def test_the_table_names_the_cpus_its_wall_times_come_from():
    row = {"variant": "awm", "gain": 0.1, "t": 2.0, "wall_s": 10.0, "curve": []}
    rows = [
        {**row, "seed": 0, "machine": {"cpu": "CPU B"}},
        {**row, "seed": 1, "machine": {"cpu": "CPU A"}},
        {**row, "seed": 2},  # a result from before runs recorded their machine
    ]
    line = script().table(rows, ["awm"], 0.1).splitlines()[-1]
    assert line.endswith("| CPU A, CPU B, not recorded |")


@pytest.mark.slow
def test_a_comparison_on_the_scenes_task_scores_held_out_accuracy(tmp_path):
    out = tmp_path / "cmp"
    command = [sys.executable, "scripts/compare_algorithms.py", "--out", str(out), "--task", "scenes",
               "--variants", "diffusion_nft", "--seeds", "0", "--steps", "2", "--eval-every", "1",
               "--batch-size", "8", "algorithm.group_size=4", "eval.max_images=12"]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
    (result,) = json.loads((out / "results.json").read_text())
    assert result["variant"] == "diffusion_nft" and result["n"] == 12
    assert [point["step"] for point in result["curve"]] == [0, 1, 2]
    assert all(0.0 <= point["reward"] <= 1.0 for point in result["curve"])
    run_scores = json.loads((out / "runs" / "diffusion_nft_seed0" / "eval.json").read_text())["scores"]
    gains = [a - b for b, a in zip(*(run_scores["scene_geneval/accuracy"][k] for k in ("before", "after")))]
    assert result["gain"] == pytest.approx(sum(gains) / len(gains))
    assert "s to +0.1" in (out / "table.md").read_text()
    manifest = json.loads((out / "runs" / "diffusion_nft_seed0" / "results" / "manifest.json").read_text())
    assert result["machine"] == manifest["machine"] and result["machine"]["cpu"]
