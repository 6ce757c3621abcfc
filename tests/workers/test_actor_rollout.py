"""The actor re-scores the engine's trajectories exactly: after a real weight sync to an
engine with its own transformer, and at once when the engine samples with the actor's."""

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.validation import validate
from tests.conftest import compose_config, training_options


def make_worker(tiny_cache, tmp_path, *overrides):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", *overrides], tmp_path))
    worker = ActorRolloutWorker(cfg, model_path(cfg.model))
    worker.setup()
    return cfg, worker


def randomise_lora(worker, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.trainable:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def rollout(cfg, worker, step=0, n=4):
    options = training_options(cfg, step)
    prompts = ["a red cat", "a blue dog"] * (n // 2)
    return worker.generate(prompts, list(range(n)), options)


def rescore(worker, batch, with_reference=True):
    """The actor's log-probs (and KL) of every SDE transition of the batch, sample-major,
    with the engine's stored log-probs of the same transitions."""
    start, stop = batch.options.sde_steps
    samples = torch.arange(len(batch)).repeat_interleave(stop - start)
    steps = torch.arange(start, stop).repeat(len(batch))
    with torch.no_grad():
        log_prob, kl = flow_grpo.score_transitions(worker, batch, samples, steps, with_reference=with_reference)
    return log_prob, batch.log_probs[samples, steps], kl


OWN_COPY = "rollout.share_actor=false"
CASES = {
    "flow_grpo": [OWN_COPY],
    "cfg": ["model.guidance_scale=3.0", OWN_COPY],
    "fast_window": ["algorithm=flow_grpo_fast", OWN_COPY],
    "base_from_sync": ["rollout.load_base=false", OWN_COPY],
    "shared_actor": [],
    # packed latents, two block containers, the distilled guidance embedding
    "flux": ["model=flux_tiny", OWN_COPY],
    # true CFG on prompts padded to each batch's longest, in Flow-GRPO-Fast's window
    "qwen_image_fast": ["model=qwen_image_tiny", "model.guidance_scale=2.0", "algorithm=flow_grpo_fast", OWN_COPY],
    "cps": ["rollout.sde_type=cps"],
}


@pytest.mark.parametrize("case", CASES)
def test_actor_log_probs_match_engine_after_sync(case, tiny_cache, tmp_path):
    cfg, worker = make_worker(tiny_cache, tmp_path, *CASES[case])
    randomise_lora(worker)
    worker.sync_weights()
    batch = rollout(cfg, worker, step=3)
    actor, engine, _ = rescore(worker, batch)
    assert len(actor) > 0 and torch.isfinite(actor).all()
    assert (actor - engine).abs().max() <= 1e-5
    if case in ("fast_window", "qwen_image_fast"):
        start, stop = batch.options.sde_steps
        assert stop - start == 2
        ode = [j for j in range(cfg.rollout.num_steps) if not start <= j < stop]
        assert torch.all(batch.log_probs[:, ode] == 0)
    if case == "cps":  # every step stochastic but the last, which lands on sigma 0
        assert batch.options.sde_steps == (0, cfg.rollout.num_steps - 1)
        assert torch.all(batch.log_probs[:, -1] == 0) and torch.all(batch.log_probs[:, :-1] != 0)


def test_stale_engine_is_detected(tiny_cache, tmp_path):
    """Without the sync an engine with its own copy samples with other weights: the check
    above could fail."""
    cfg, worker = make_worker(tiny_cache, tmp_path, OWN_COPY)
    randomise_lora(worker)
    batch = rollout(cfg, worker)
    actor, engine, _ = rescore(worker, batch)
    assert (actor - engine).abs().max() > 1e-4


def test_shared_engine_samples_with_the_actor_itself(tiny_cache, tmp_path):
    """By default one transformer serves both: the engine holds no copy of its own, a
    changed LoRA is sampled at once without a sync, and the sync sends nothing."""
    cfg, worker = make_worker(tiny_cache, tmp_path)
    assert worker.engine.shares_actor and worker.engine.transformer is worker.actor
    transformers = {id(m) for m in worker.engine.pipe.components.values() if isinstance(m, type(worker.actor))}
    assert transformers == {id(worker.actor)}
    randomise_lora(worker)
    worker.actor.train()
    batch = rollout(cfg, worker)
    assert worker.actor.training  # sampling left the actor's mode as it was
    actor, engine, _ = rescore(worker, batch)
    assert (actor - engine).abs().max() <= 1e-5
    assert worker.sync_weights()["sync/megabytes"] == 0


def test_kl_to_reference_is_zero_at_init_and_not_after(tiny_cache, tmp_path):
    cfg, worker = make_worker(tiny_cache, tmp_path, "algorithm.kl_coef=0.1")
    batch = rollout(cfg, worker)
    _, _, kl = rescore(worker, batch)
    assert torch.all(kl == 0)
    randomise_lora(worker)
    _, _, kl = rescore(worker, batch)
    assert torch.all(kl > 0)


def test_update_changes_only_lora(tiny_cache, tmp_path):
    cfg, worker = make_worker(tiny_cache, tmp_path)
    frozen = {n: p.detach().clone() for n, p in worker.actor.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in worker.actor.named_parameters() if p.requires_grad}
    batch = rollout(cfg, worker, n=8)
    advantages = torch.linspace(-1, 1, len(batch))
    metrics = worker.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, advantages), seed=0)
    assert metrics["grad_norm"] > 0 and 0 <= metrics["clip_fraction"] <= 1
    now = dict(worker.actor.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    assert any(not torch.equal(now[n], p) for n, p in lora.items())
