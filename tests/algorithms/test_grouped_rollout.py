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


def test_per_group_initial_noise_is_shared_in_a_group_and_parts_by_the_sde(worker, tiny_cache, tmp_path):
    """rollout.initial_noise=per_group: a group's images start from one latent (the groups from
    different ones) and part by their SDE steps, whatever micro-batches split the groups; with
    per_image each image starts from its own. Flow-GRPO takes the option at validation."""
    from omni.config.rollout import InitialNoise
    from omni.validation import validate
    from tests.conftest import compose_config

    validate(compose_config([f"model.cache_dir={tiny_cache}", "rollout.initial_noise=per_group"], tmp_path))
    cfg = copy.deepcopy(worker.cfg)
    cfg.trainer.batch_size, cfg.rollout.num_steps, cfg.reward.overlap = 8, 3, False
    ctx = StepContext(cfg, None, load_prompts("omni:colors_train"), [], WeightedReward({"brightness": {}}), worker)
    engine_batch = worker.engine.micro_batch_size
    batches = {}
    try:
        for noise, micro_batch in (("per_group", 3), ("per_group", 8), ("per_image", 8)):
            cfg.rollout.initial_noise, worker.engine.micro_batch_size = InitialNoise(noise), micro_batch
            batches[noise, micro_batch] = grouped_rollout(ctx, step=0, group_size=4, sde_steps=(0, 2)).batch
    finally:
        worker.engine.micro_batch_size = engine_batch
    shared, unsplit, own = batches["per_group", 3], batches["per_group", 8], batches["per_image", 8]
    # a group split over micro-batches samples the same (up to the kernels' batch-size rounding)
    for name in ("latents", "log_probs", "images"):
        assert torch.allclose(getattr(shared, name), getattr(unsplit, name), atol=1e-4), name
    start, end = shared.latents[:, 0].flatten(1), shared.latents[:, -1].flatten(1)
    for group in (slice(0, 4), slice(4, 8)):
        assert torch.equal(start[group], start[group][:1].expand(4, -1))
        assert (torch.cdist(end[group], end[group]) + torch.eye(4) > 1e-3).all()  # parted by the SDE
    assert not torch.allclose(start[0], start[4])
    own_start = own.latents[:, 0].flatten(1)
    assert (torch.cdist(own_start, own_start) + torch.eye(8) > 1e-3).all()
