"""The training loop on the tiny SD3, in process: a non-finite reward, loss or gradient never
reaches the weights, Ctrl-C says how to continue, and an eval-only run evaluates."""

import math

import pytest
import torch

from omni import checkpoint
from omni.algorithms import flow_grpo
from omni.algorithms.advantages import group_advantages, masked_group_advantages
from omni.models.sd3 import FAMILY
from omni.rewards import NonFiniteReward
from omni.rewards.brightness import Brightness
from omni.trainer import TrainingStopped, run
from omni.validation import ConfigError, validate
from tests.conftest import compose_config

SMALL = [
    "trainer.batch_size=8",
    "algorithm.group_size=4",
    "eval.images_per_prompt=1",
    "trainer.progress_bar=false",
]


def config(tiny_cache, tmp_path, *overrides):
    return compose_config([f"model.cache_dir={tiny_cache}", *SMALL, *overrides], tmp_path)


def nan_on_second_image(monkeypatch):
    def score(self, images, prompts):
        scores = images.mean(dim=(1, 2, 3))
        scores[1::8] = float("nan")
        return scores

    monkeypatch.setattr(Brightness, "score", score)


def test_nan_reward_fails_the_step_naming_reward_step_and_count(tiny_cache, tmp_path, monkeypatch):
    nan_on_second_image(monkeypatch)
    with pytest.raises(NonFiniteReward, match="during the evaluation before training: 'brightness' on 3 of 20 images"):
        run(config(tiny_cache, tmp_path, "trainer.steps=1"))
    assert checkpoint.latest_checkpoint(tmp_path / "checkpoints") is None


def test_nan_reward_dropped_leaves_those_images_out(tiny_cache, tmp_path, monkeypatch):
    nan_on_second_image(monkeypatch)
    rewards = torch.tensor([0.1, float("nan"), 0.5, 0.3, 0.2, 0.2, 0.4, float("inf")])
    valid = torch.isfinite(rewards)
    advantages = masked_group_advantages(rewards, valid, group_size=4)
    assert advantages[1] == 0 and advantages[7] == 0 and torch.isfinite(advantages).all()
    expected = group_advantages(torch.tensor([0.1, 0.5, 0.3]), 3)
    assert torch.allclose(advantages[[0, 2, 3]], expected)
    final = run(config(tiny_cache, tmp_path, "trainer.steps=2", "reward.nonfinite=drop"))
    assert math.isfinite(final)
    lora, _ = checkpoint.load_checkpoint(tmp_path / "checkpoints" / "step_000002", FAMILY)
    assert all(torch.isfinite(t).all() for t in lora.values())


def test_non_finite_gradients_skip_the_step_then_stop_the_run(tiny_cache, tmp_path, monkeypatch):
    real_loss = flow_grpo.clipped_policy_loss
    monkeypatch.setattr(
        flow_grpo, "clipped_policy_loss", lambda *a: (real_loss(*a)[0] * float("nan"), *real_loss(*a)[1:])
    )
    cfg = config(tiny_cache, tmp_path, "trainer.steps=5", "trainer.max_bad_steps=2")
    with pytest.raises(TrainingStopped, match="2 steps in a row \\(up to step 2\\) had a non-finite"):
        run(cfg)


def test_skipped_optimizer_step_keeps_weights_and_optimizer_state(tiny_cache, tmp_path):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    worker = ActorRolloutWorker(
        validate(config(tiny_cache, tmp_path)), model_path(validate(config(tiny_cache, tmp_path)).model)
    )
    worker.setup()
    before = [p.detach().clone() for p in worker.trainable]
    for p in worker.trainable:
        p.grad = torch.full_like(p, float("nan"))
    assert math.isnan(worker.optimizer_step())
    assert all(torch.equal(a, b) for a, b in zip(before, worker.trainable)) and not worker.optimizer.state
    worker.shutdown()


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tiny_cache, tmp_path, monkeypatch, caplog):
    real_step = flow_grpo.FlowGRPO.step

    def interrupted_at_third(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(flow_grpo.FlowGRPO, "step", interrupted_at_third)
    with pytest.raises(SystemExit) as info:
        run(config(tiny_cache, tmp_path, "trainer.steps=4", "trainer.save_every=1"))
    assert info.value.code == 130
    out = caplog.text
    assert "interrupted during training step 3" in out and "step_000002" in out and "trainer.resume=auto" in out


def test_eval_only_alone_evaluates_and_steps_zero_needs_it(tiny_cache, tmp_path, caplog):
    with pytest.raises(ConfigError, match="trainer.steps=0.*trainer.eval_only=true"):
        validate(config(tiny_cache, tmp_path, "trainer.steps=0"))
    with caplog.at_level("INFO", logger="omni"):
        reward = run(config(tiny_cache, tmp_path, "trainer.eval_only=true"))  # trainer.steps keeps its default
    assert math.isfinite(reward) and "eval-only run" in caplog.text
    assert not (tmp_path / "checkpoints").exists()
