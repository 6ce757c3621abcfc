"""The rollout the online algorithms share, with `reward.overlap`: each part of the rollout is
scored while the next is sampled (a reward that notes whether sampling was under way when it
ran shows it), and the batch and scores equal those of sampling then scoring the whole."""

import copy
import threading

import torch

from omni.algorithms.base import grouped_rollout
from omni.context import StepContext
from omni.data.prompts import load_prompts
from omni.rewards import WeightedReward


class NotedSampling:
    """The real worker, noting while its `generate` runs."""

    def __init__(self, worker):
        self.worker, self.sampling, self.calls = worker, threading.Event(), 0

    def generate(self, *args):
        self.sampling.set()
        try:
            self.calls += 1
            return self.worker.generate(*args)
        finally:
            self.sampling.clear()


def test_scoring_overlaps_sampling_with_the_same_results(worker):
    cfg = copy.deepcopy(worker.cfg)
    cfg.trainer.batch_size, cfg.algorithm.group_size, cfg.rollout.micro_batch_size, cfg.rollout.num_steps = 8, 4, 2, 3
    noted = NotedSampling(worker)
    reward = WeightedReward({"brightness": {"batch_size": 3}, "jpeg_compressibility": {}})
    during_sampling = []
    score = reward.rewards["brightness"].score
    reward.rewards["brightness"].score = lambda images, prompts: (
        during_sampling.append(noted.sampling.is_set()) or score(images, prompts)
    )
    ctx = StepContext(cfg, None, load_prompts("omni:colors_train"), [], reward, worker=noted)
    engine_batch, worker.engine.micro_batch_size = worker.engine.micro_batch_size, 2
    try:
        results = {}
        for overlap in (True, False):
            cfg.reward.overlap = overlap
            calls, during_sampling[:] = noted.calls, []
            results[overlap] = grouped_rollout(ctx, step=0, group_size=4, sde_steps=(0, 2))
            results[overlap].calls, results[overlap].during = noted.calls - calls, list(during_sampling)
    finally:
        worker.engine.micro_batch_size = engine_batch
    on, off = results[True], results[False]
    assert (on.calls, off.calls) == (4, 1)  # four parts of 2 images, or the whole batch at once
    assert len(on.during) == len(off.during) == 4  # brightness: one call per part either way
    assert any(on.during) and not any(off.during)  # a part was scored while the next was sampled
    assert on.prompts == off.prompts
    for name in ("images", "latents", "log_probs"):
        assert torch.equal(getattr(on.batch, name), getattr(off.batch, name)), name
    assert set(on.scores) == {"reward", "brightness", "jpeg_compressibility"}
    assert all(torch.equal(on.scores[k], off.scores[k]) for k in off.scores)
    assert on.timings["time/reward_wait"] <= on.timings["time/reward"] + 0.05


def test_flow_grpo_step_under_gdpo(fresh, monkeypatch):
    """With reward.aggregation=gdpo, Flow-GRPO's step trains on GDPO's advantages of the
    rollout's scores, logs each reward's advantage spread, and moves the LoRA."""
    from omni.algorithms.advantages import clip_advantages, gdpo_advantages
    from omni.algorithms.flow_grpo import FlowGRPO

    cfg = fresh.cfg
    monkeypatch.setattr(cfg.trainer, "batch_size", 4)
    monkeypatch.setattr(cfg.algorithm, "group_size", 2)
    monkeypatch.setattr(cfg.reward, "aggregation", "gdpo")
    reward = WeightedReward({"brightness": {"weight": 0.7}, "jpeg_compressibility": {"weight": 0.3}})
    ctx = StepContext(cfg, None, load_prompts("omni:colors_train"), [], reward, worker=fresh)
    seen = {}
    sample_and_score, apply_update = ctx.sample_and_score, fresh.apply_update

    def noted_sampling(*args):
        seen["rollout"] = sample_and_score(*args)
        return seen["rollout"]

    def noted_update(fn, batch, seed):
        seen["batch"] = batch
        return apply_update(fn, batch, seed)

    ctx.sample_and_score = noted_sampling
    monkeypatch.setattr(fresh, "apply_update", noted_update)
    before = [p.detach().clone() for p in fresh.trainable]
    metrics = FlowGRPO(ctx).step(0)
    scores = seen["rollout"][1]
    expected, _ = gdpo_advantages(scores, reward.weights, torch.ones(4, dtype=torch.bool), 2)
    assert torch.allclose(seen["batch"].advantages, clip_advantages(expected, cfg.algorithm.adv_clip_max))
    assert {"reward/brightness/advantage_std", "reward/jpeg_compressibility/advantage_std"} <= set(metrics)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.trainable, before))
