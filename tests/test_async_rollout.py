"""trainer.rollout_mode=async (omni/async_rollout.py): a rollout is sampled with the weights
version it was pinned to, a stale batch is scored against its own behaviour log-probs, bad
settings fail before any model loads; on Ray (slow), max_staleness=0 is the synchronous run
bit for bit, a resumed run redoes its pending rollouts exactly, and more rollout workers than
the cluster holds fail before any model loads."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.async_rollout import AsyncRollouts
from omni.config.errors import ConfigError
from omni.trainer import Trainer, model_path
from omni.validation import validate
from tests.conftest import compose_config, one_process_group_at_a_time
from tests.recipes.test_train import final_lora, train

SMALL = [
    "trainer.batch_size=8", "algorithm.group_size=4", "trainer.micro_batch_size=4", "eval.images_per_prompt=1",
    "rollout.num_steps=4", "eval.max_images=4",
]  # fmt: skip
ASYNC = "trainer.rollout_mode=async"


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["trainer.rollout_mode=later"], "trainer.rollout_mode=later"),
        ([ASYNC, "trainer.max_staleness=-1"], "trainer.max_staleness=-1"),
        ([ASYNC, "trainer.rollout_workers=3"], "trainer.rollout_workers=3"),
        ([ASYNC, "algorithm=grpo_guard"], "algorithm.name=grpo_guard"),
        ([ASYNC, "algorithm=dgpo"], "algorithm.name=dgpo"),
        ([ASYNC, "rollout=vllm", "rollout.options.url=http://127.0.0.1:1"], "rollout.engine=vllm"),
        ([ASYNC, "sentinel.enabled=true", "sentinel.action=rollback"], "sentinel.action=rollback"),
    ],
)
def test_bad_async_settings_fail_before_any_model_loads(overrides, named, tmp_path):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(compose_config(["model.cache_dir=/nonexistent", *SMALL, *overrides], tmp_path))


def lora_like(worker, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) * 0.3 for name, t in worker.lora_state_dict().items()}


@pytest.fixture
def trainer_and_rollout_worker(tiny_cache, tmp_path):
    """A set-up synchronous trainer (its worker trains) and a second in-process worker that
    serves as the rollout group."""
    from omni.workers.actor_rollout import ActorRolloutWorker

    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", *SMALL, "trainer.max_staleness=2"], tmp_path))
    trainer = Trainer(cfg)
    trainer.setup()
    rollout_worker = ActorRolloutWorker(cfg, model_path(cfg.model))
    rollout_worker.setup()
    yield trainer, rollout_worker
    rollout_worker.shutdown()
    trainer.cleanup()


def test_each_rollout_is_sampled_with_the_weights_version_it_was_pinned_to(trainer_and_rollout_worker):
    """max_staleness=2: steps 0-2 are pinned to the initial weights, step 3 to those after
    update 1. The rollout thread is held inside step 1 until version 1 is out, so a rollout
    that took the newest weights instead of its pinned ones would differ."""
    trainer, rollout_worker = trainer_and_rollout_worker
    algorithm = trainer.algorithm
    versions = [trainer.worker.lora_state_dict(), *(lora_like(trainer.worker, seed) for seed in (1, 2))]
    published = threading.Event()

    def rollout(ctx, step):
        if step == 1:
            published.wait(timeout=60)
        return algorithm.rollout(step, ctx)

    rollouts = AsyncRollouts(trainer.ctx, rollout, "", group=rollout_worker)
    rollouts.publish(0, versions[0])
    try:
        taken = []
        for step in range(4):  # the trainer's loop: take, update (here: new weights), publish
            taken.append(rollouts.take(step))
            rollouts.publish(step + 1, versions[min(step + 1, 2)])
            published.set()
    finally:
        rollouts.close()
    pinned = {0: 0, 1: 0, 2: 0, 3: 1}
    for step, (scored, staleness) in enumerate(taken):
        assert staleness == step - pinned[step]
        trainer.worker.load_adapter(versions[pinned[step]])
        expected = algorithm.rollout(step)
        assert torch.equal(scored.batch.latents, expected.batch.latents), step
        assert torch.equal(scored.batch.log_probs, expected.batch.log_probs), step
        assert torch.equal(scored.scores["reward"], expected.scores["reward"]), step


def test_a_stale_batch_is_scored_against_its_own_behaviour_log_probs(trainer_and_rollout_worker):
    trainer, _ = trainer_and_rollout_worker
    worker, algorithm = trainer.worker, trainer.algorithm
    worker.load_adapter(lora_like(worker, 0))
    stale = algorithm.rollout(0)  # sampled with the behaviour weights
    worker.load_adapter(lora_like(worker, 1))  # the update's weights have moved on since
    batch, _ = algorithm.update_batch(stale)
    start, stop = batch.rollout.options.sde_steps
    samples = torch.arange(len(batch)).repeat_interleave(stop - start)
    steps = torch.arange(start, stop).repeat(len(batch))
    with torch.no_grad():
        current = flow_grpo.score_steps(worker, batch.rollout, samples, steps).log_prob
    expected_ratio = float(torch.exp(current - batch.rollout.log_probs[samples, steps]).mean())
    cfg = worker.cfg.algorithm
    cfg.num_minibatches, cfg.num_inner_epochs = 1, 1  # one step: the ratio is taken before the weights move
    metrics = worker.apply_update(flow_grpo.update, batch, 0)
    assert abs(expected_ratio - 1) > 1e-3  # the behaviour policy is not the current one
    assert metrics["ratio"] == pytest.approx(expected_ratio, rel=1e-5)


# ----------------------------------------------------------------- on Ray, end to end
def run_lora(run_dir, tiny_cache, *overrides, step):
    with one_process_group_at_a_time():
        train(run_dir, tiny_cache, *SMALL, *overrides, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return final_lora(run_dir, step)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_async_at_staleness_zero_is_the_synchronous_run_and_a_stale_run_resumes_exactly(tmp_path, tiny_cache):
    """Same threads per process (one), so the rollout worker's samples are the trainer's own.
    The stale run is resumed from its first checkpoint, with a rollout pending (pinned to the
    initial weights), and must end where the uninterrupted run ended."""
    steps = ["trainer.steps=3", "trainer.save_every=1"]
    sync = run_lora(tmp_path / "sync", tiny_cache, *steps, step=3)
    fresh = run_lora(tmp_path / "async0", tiny_cache, *steps, ASYNC, "trainer.max_staleness=0", step=3)
    assert max_difference(sync, fresh) == 0

    stale_run = [*steps, ASYNC, "trainer.max_staleness=1"]
    stale = run_lora(tmp_path / "async1", tiny_cache, *stale_run, step=3)
    assert max_difference(sync, stale) > 0
    history = json.loads((tmp_path / "async1" / "results" / "history.json").read_text())
    assert [value for _, value in history["train/staleness"]] == [0.0, 1.0, 1.0]
    resume = f"trainer.resume={tmp_path / 'async1' / 'checkpoints' / 'step_000001'}"
    assert max_difference(stale, run_lora(tmp_path / "resumed", tiny_cache, *stale_run, resume, step=3)) == 0


@pytest.mark.slow
def test_rollout_workers_the_cluster_cannot_hold_fail_before_any_model_loads(tmp_path, tiny_cache):
    with one_process_group_at_a_time():
        result = train(tmp_path / "run", tiny_cache, *SMALL, ASYNC, "trainer.rollout_workers=8", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "trainer.rollout_workers=8" in output and "the Ray cluster has" in output, output[-3000:]
    assert "Loading pipeline components" not in output
