"""What a new user sees in the first hour, through the real CLI on the tiny SD3: the metrics
reach Hydra's log file as well as the console, the progress bar shows what moves, the
default run prints no warning of our own making, and `trainer.eval_only=true` alone evaluates."""

import re

import pytest

from tests import cli_process


def cli(run_dir, cache, *overrides):
    """`python recipes/train.py` as a user types it (progress bar on), 2 steps."""
    command = ["recipes/train.py", f"hydra.run.dir={run_dir}", f"model.cache_dir={cache}", *overrides]
    result = cli_process.run(command, timeout=600)
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, tiny_cache):
    run_dir = tmp_path_factory.mktemp("default")
    cli(run_dir, tiny_cache, "trainer.steps=1")  # builds the tiny model, so the run below only trains
    return run_dir, cli(run_dir / "again", tiny_cache, "trainer.steps=2")


def test_metrics_reach_hydras_log_file_and_the_console(default_run):
    run_dir, result = default_run
    log = (run_dir / "again" / "train.log").read_text()
    for line in (
        "step 0: eval/brightness=",
        "step 2: eval/brightness=",
        "eval reward (held-out prompts and seeds): before",
    ):
        assert line in log, f"{line!r} not in train.log:\n{log}"
        assert line in result.stdout, f"{line!r} not on the console"


def test_progress_bar_shows_reward_kl_and_clipped_fraction(default_run):
    _, result = default_run
    # tqdm writes to stderr; the final evaluation's bar comes after the training bar's last state
    bars = result.stderr.replace("\r", "\n").strip().splitlines()
    last = [line for line in bars if line.startswith("flow_grpo:")][-1]
    assert any(line.startswith("eval step ") for line in bars)
    assert re.search(r"reward=0\.\d+, kl=[-\d.e]+, clipped=[\d.e-]+", last), last
    assert "loss=" not in result.stderr


def test_default_run_prints_no_warning(default_run):
    _, result = default_run
    output = result.stdout + result.stderr
    for warning in ("Warning", "WARNING", "should be kept in float32", "deprecated"):
        assert warning not in output, f"{warning!r} in the default run's output:\n{output[-3000:]}"


def test_eval_only_alone_evaluates_and_exits(tmp_path, tiny_cache):
    result = cli(tmp_path, tiny_cache, "trainer.eval_only=true")
    assert "eval-only run (trainer.eval_only=true, no training)" in result.stdout
    assert "eval-only run" in (tmp_path / "train.log").read_text()
    assert not (tmp_path / "checkpoints").exists() and "flow_grpo:" not in result.stderr  # no step, no bar


def test_reward_metrics_carry_the_rewards_name(tmp_path, tiny_cache):
    """`reward=frame_brightness` (each frame's brightness, averaged over the clip) is logged as
    such, not as the generic `frame_average` that computes it."""
    result = cli(tmp_path, tiny_cache, "model=wan_tiny", "reward=frame_brightness", "trainer.eval_only=true")
    assert "eval/frame_brightness=" in (tmp_path / "train.log").read_text()
    assert "frame_average" not in result.stdout


def logged(log: str, key: str):
    """{step: value} of `key` in the metric lines of a train.log."""
    return {
        int(step): float(value) for step, value in re.findall(rf"step (\d+): .*\b{re.escape(key)}=([-\d.e+]+)", log)
    }


def test_learning_rate_warms_up_then_follows_the_schedule(tmp_path, tiny_cache):
    """The rate the optimizer holds at each step, as the worker reports it: a warm-up step
    at half the rate, then half a cosine."""
    cli(
        tmp_path,
        tiny_cache,
        "trainer.steps=3",
        "trainer.lr=0.01",
        "trainer.lr_schedule=cosine",
        "trainer.warmup_steps=1",
        "logger.console_every=1",
        "trainer.progress_bar=false",
    )
    rates = logged((tmp_path / "train.log").read_text(), "train/lr")
    assert rates == pytest.approx({1: 0.005, 2: 0.01, 3: 0.005}), rates
