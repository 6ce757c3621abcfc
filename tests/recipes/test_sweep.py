"""Sweeps through the real CLI on the tiny model: a Hydra multirun (an Optuna search) gives
each job its own directory and, with 2 workers, its own Ray, started and stopped by the job,
and the search maximises the final held-out reward that recipes/train.py returns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import one_process_group_at_a_time

REPO = Path(__file__).resolve().parents[2]
SHORT = [
    "trainer.steps=1", "trainer.batch_size=8", "algorithm.group_size=4", "trainer.eval_images_per_prompt=1", "rollout.num_steps=4",
]  # fmt: skip


def sweep(sweep_dir, cache, *overrides, timeout=600):
    command = [
        sys.executable, "recipes/train.py", "-m", f"hydra.sweep.dir={sweep_dir}", f"model.cache_dir={cache}",
        "trainer.progress_bar=false", *overrides,
    ]  # fmt: skip
    with one_process_group_at_a_time():  # with 2 workers each job starts a Ray cluster
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"train.py -m failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def final_reward(job_dir: Path) -> float:
    after = json.loads((job_dir / "eval.json").read_text())["after"]
    return sum(after) / len(after)


@pytest.mark.slow
def test_optuna_multirun_gives_each_job_its_directory_and_ray_and_maximises_the_reward(tmp_path, tiny_cache):
    """One sweep checks both: an Optuna search of 2 trials, each job with 2 workers."""
    output = sweep(tmp_path, tiny_cache, "hparams_search=optuna", "hydra.sweeper.n_trials=2", "trainer.n_workers=2", *SHORT)
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
