"""Sweeps through the real CLI on the tiny model: a Hydra multirun (an Optuna search) gives
each job its own directory and, with 2 workers, its own Ray, started and stopped by the job,
and the search maximises the final held-out reward that recipes/train.py returns. A sweep
with a job that cannot run is refused before any job starts (omni/sweep.py)."""

import json
from pathlib import Path

import pytest
import yaml

from tests import cli_process
from tests.conftest import one_process_group_at_a_time

SHORT = [
    "trainer.steps=1",
    "trainer.batch_size=8",
    "algorithm.group_size=4",
    "eval.images_per_prompt=1",
    "rollout.num_steps=4",
]


def sweep(sweep_dir, cache, *overrides, timeout=600):
    command = [
        "recipes/train.py", "-m", f"hydra.sweep.dir={sweep_dir}", f"model.cache_dir={cache}",
        "trainer.progress_bar=false", *overrides,
    ]  # fmt: skip
    with one_process_group_at_a_time():  # with 2 workers each job starts a Ray cluster
        result = cli_process.run(command, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"train.py -m failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def final_reward(job_dir: Path) -> float:
    after = json.loads((job_dir / "eval.json").read_text())["after"]
    return sum(after) / len(after)


@pytest.mark.slow
def test_optuna_multirun_gives_each_job_its_directory_and_ray_and_maximises_the_reward(tmp_path, tiny_cache):
    """One sweep checks both: an Optuna search of 2 trials, each job with 2 workers."""
    output = sweep(
        tmp_path, tiny_cache, "hparams_search=optuna", "hydra.sweeper.n_trials=2", "trainer.n_workers=2", *SHORT
    )
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"trainer.lr", "algorithm.clip_range"}
    for job in jobs:
        assert "trainer.lr=" in (job / ".hydra" / "overrides.yaml").read_text()
        assert (job / "checkpoints" / "step_000001" / "pytorch_lora_weights.safetensors").is_file()
    assert "Best value" in output
    assert results["best_value"] == pytest.approx(max(final_reward(job) for job in jobs), rel=1e-6)
    # the second job could not place its workers on 2 CPUs had the first kept its Ray
    assert output.count("Started a local Ray instance") == 2


def test_sweep_with_a_bad_job_is_refused_before_any_job_starts(tmp_path, tiny_cache):
    """The bad job comes last: without the check the good one would have run first."""
    command = [
        "recipes/train.py",
        "-m",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"model.cache_dir={tiny_cache}",
        "trainer.progress_bar=false",
        *SHORT,
        "trainer.lr=1e-2,-1",
        "model.lora.rank=4,0",
    ]
    result = cli_process.run(command, timeout=600)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "the sweep is refused before any job starts, 3 of its 4 jobs cannot run: "
        "job #1 (trainer.lr=0.01 model.lora.rank=0): model.lora.rank=0 must be positive; "
        "job #2 (trainer.lr=-1 model.lora.rank=4): trainer.lr=-1.0 must be positive; "
        "job #3 (trainer.lr=-1 model.lora.rank=0): model.lora.rank=0 must be positive"
    )
    assert not (tmp_path / "sweep").exists()  # no job started, no directory written


def test_sweep_of_good_jobs_runs_them_all(tmp_path, tiny_cache):
    output = sweep(tmp_path, tiny_cache, *SHORT, "trainer.lr=1e-2,2e-2")
    assert "validated the sweep's 2 jobs before starting any job" in output
    assert [final_reward(tmp_path / job) > 0 for job in ("0", "1")] == [True, True]


def test_search_with_bad_fixed_settings_is_refused_before_any_trial(tmp_path, tiny_cache):
    """An Optuna search draws its trials as it goes; its fixed settings are checked first."""
    command = [
        "recipes/train.py",
        "-m",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"model.cache_dir={tiny_cache}",
        "hparams_search=optuna",
        "experiment=tiny_sweep",
        "hydra.sweeper.n_trials=1",
        "trainer.steps=-1",
    ]
    result = cli_process.run(command, timeout=600)
    assert result.returncode == 1 and not (tmp_path / "sweep").exists()
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "the sweep is refused before any job starts, 1 of its 1 jobs cannot run: job #0 (the fixed settings): "
            "trainer.steps=-1"
        )
    )
