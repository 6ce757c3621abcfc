"""scripts/bench_async.py: the layouts its two sides compare, as validated configs (no model
loads): the same processes on both sides, and with --one-gpu both sides on one device."""

import pytest

from omni.async_rollout import rollout_group_config
from omni.validation import validate
from tests.conftest import compose_config
from tests.script_modules import load_script


def script():
    return load_script("bench_async")


def side(mode: str, one_gpu: bool, workers: int = 2):
    return validate(compose_config(script().side_overrides(workers, mode, 1, one_gpu))).trainer


def test_the_sides_run_the_same_number_of_processes():
    sync, run = side("sync", False), side("async", False)
    assert (sync.n_workers, sync.rollout_mode) == (2, "sync")
    assert run.rollout_mode == "async" and run.max_staleness == 1
    assert run.n_workers + run.rollout_workers == sync.n_workers == 2  # one trains, one rolls out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_gpu_puts_both_sides_on_one_device(mode):
    trainer = side(mode, True)
    assert (trainer.n_workers, trainer.n_gpus_per_node, trainer.device) == (1, 1, "cuda")
    assert trainer.rollout_mode == mode
    if mode == "async":
        rollout = rollout_group_config(compose_config(script().side_overrides(2, mode, 1, True))).trainer
        # the rollout worker asks Ray for the one GPU; the trainer (no Ray actor) shares it
        assert (rollout.n_workers, rollout.n_gpus_per_node) == (1, 1)
