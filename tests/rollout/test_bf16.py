"""Flow-GRPO with a bf16 transformer: the trajectory and the SDE step with its log-prob stay
fp32 on both sides (the engine's sampler and the actor's re-scoring), so the importance ratio
resolves changes far below the clip range instead of moving in bf16-sized jumps."""

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.context import step_seeds
from omni.models.sd3 import FAMILY
from omni.validation import validate
from tests.conftest import compose_config, training_options

PROMPTS = ["a red cat", "a blue dog"]


@pytest.fixture(scope="module")
def worker(tiny_cache, tmp_path_factory):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    # an engine with its own copy, as a separate engine process has: its LoRA must compute
    # as the actor's does (shared by default, the two are one module)
    overrides = [
        f"model.cache_dir={tiny_cache}",
        "model.dtype=bfloat16",
        "trainer.micro_batch_size=64",
        "rollout.share_actor=false",
    ]
    cfg = validate(compose_config(overrides, tmp_path_factory.mktemp("run")))
    worker = ActorRolloutWorker(cfg, model_path(cfg.model))
    worker.setup()
    yield worker
    worker.shutdown()


def rollout(worker, n=2, step=0):
    prompts = [p for p in PROMPTS for _ in range(n // 2)]
    return worker.generate(prompts, step_seeds(0, step, n), training_options(worker.cfg, step))


def transitions(batch):
    start, stop = batch.options.sde_steps
    samples = torch.arange(len(batch)).repeat_interleave(stop - start)
    return samples, torch.arange(start, stop).repeat(len(batch))


def actor_log_probs(worker, batch):
    samples, steps = transitions(batch)
    with torch.no_grad():
        log_prob, _ = flow_grpo.score_transitions(worker, batch, samples, steps, with_reference=False)
    return log_prob


@torch.no_grad()
def recomputed_log_probs(transformer, batch):
    """The SDE log-prob of each stored transition in float64, written out here, from the
    stored trajectory and the bf16 transformer's velocity (fed bf16 latents, fp32 timesteps)."""
    samples, steps = transitions(batch)
    x, x_next = batch.latents[samples, steps].double(), batch.latents[samples, steps + 1].double()
    sigma, sigma_next = batch.sigmas[steps].double(), batch.sigmas[steps + 1].double()
    velocity = transformer(
        hidden_states=x.to(torch.bfloat16),
        timestep=(sigma * 1000).float(),
        encoder_hidden_states=batch.cond.embeds[samples].to(torch.bfloat16),
        pooled_projections=batch.cond.pooled[samples].to(torch.bfloat16),
        return_dict=False,
    )[0].double()
    sigma_max = float(batch.sigmas[1])
    s, dt = sigma.view(-1, 1, 1, 1), (sigma_next - sigma).view(-1, 1, 1, 1)
    std = batch.options.noise_level * torch.sqrt(s / (1 - torch.where(s >= 1, torch.full_like(s, sigma_max), s)))
    mean = x * (1 + std**2 / (2 * s) * dt) + velocity * (1 + std**2 * (1 - s) / (2 * s)) * dt
    scale = std * torch.sqrt(-dt)
    log_p = (
        -((x_next - mean) ** 2) / (2 * scale**2)
        - torch.log(scale)
        - 0.5 * torch.log(torch.tensor(2 * torch.pi, dtype=torch.float64))
    )
    return log_p.mean(dim=(1, 2, 3))


def test_trajectory_and_log_probs_are_fp32(worker):
    batch = rollout(worker)
    assert batch.latents.dtype == torch.float32 and batch.log_probs.dtype == torch.float32
    assert actor_log_probs(worker, batch).dtype == torch.float32


def test_engine_and_actor_log_probs_are_fp32_math_on_the_bf16_velocity(worker):
    batch = rollout(worker)
    samples, steps = transitions(batch)
    engine = batch.log_probs[samples, steps].double()
    actor = actor_log_probs(worker, batch).double()
    engine_ref = recomputed_log_probs(worker.engine.transformer, batch)
    actor_ref = recomputed_log_probs(worker.actor, batch)
    assert (engine - engine_ref).abs().max() < 1e-6
    assert (actor - actor_ref).abs().max() < 1e-6
    assert (actor - engine).abs().max() < 1e-6


def test_engine_matches_the_actor_with_a_trained_lora(worker):
    """Both compute the LoRA in fp32 on the bf16 base: after a sync of a non-zero LoRA the
    actor re-scores the engine's trajectory exactly (a bf16 LoRA in the engine was 3e-4 off,
    more than the paper's clip range)."""
    saved = [p.detach().clone() for p in worker.trainable]
    generator = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for p in worker.trainable:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        worker.sync_weights()
        assert all(p.dtype == torch.float32 for n, p in worker.engine.transformer.named_parameters() if "lora_" in n)
        batch = rollout(worker)
        samples, steps = transitions(batch)
        assert (actor_log_probs(worker, batch) - batch.log_probs[samples, steps]).abs().max() < 1e-6
    finally:
        with torch.no_grad():
            for p, s in zip(worker.trainable, saved):
                p.copy_(s)
        worker.sync_weights()


def test_predict_velocity_keeps_the_timestep_fp32():
    """sigma * 1000 in fp32: rounding sigma to bf16 first moves the timestep by up to 2."""
    seen = {}

    def transformer(hidden_states, timestep, **kwargs):
        seen["timestep"] = timestep
        return (hidden_states,)

    sigmas = torch.tensor([0.7003, 0.9961])
    latents = torch.zeros(2, 4, 2, 2, dtype=torch.bfloat16)
    cond = FAMILY.conditioning(torch.zeros(2, 3, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16))
    velocity = FAMILY.predict_velocity(transformer, latents, sigmas, cond, 1.0)
    assert torch.equal(seen["timestep"], sigmas * 1000)
    assert velocity.dtype == torch.float32


def test_ratio_moves_smoothly_under_a_small_lora_change(worker):
    """The mean |ratio - 1| grows in proportion to a LoRA perturbation scaled by eps, and the log-prob
    changes are fp32 numbers, not multiples of a bf16 ulp. (Below eps ~1e-2 the tiny model's
    bf16 velocity sets a floor of a few 1e-4: any weight change flips the rounding of some of
    its 256 latent elements.)"""
    saved = [p.detach().clone() for p in worker.trainable]
    generator = torch.Generator().manual_seed(0)
    direction = [torch.randn(p.shape, generator=generator) for p in worker.trainable]
    try:
        with torch.no_grad():
            for p in worker.trainable:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        worker.sync_weights()
        batch = rollout(worker)
        old = actor_log_probs(worker, batch)
        changes = [log_prob_change(worker, batch, old, direction, eps) for eps in (2e-2, 4e-2, 8e-2)]
    finally:
        with torch.no_grad():
            for p, s in zip(worker.trainable, saved):
                p.copy_(s)
        worker.sync_weights()
    deviations = [float((torch.exp(c) - 1).abs().mean()) for c in changes]
    print("eps 2e-2, 4e-2, 8e-2: mean |ratio - 1| =", deviations)
    for small, large in zip(deviations, deviations[1:]):
        assert 1.6 < large / small < 2.5, deviations
    assert len(torch.unique(changes[0])) == len(changes[0]), changes[0]


def log_prob_change(worker, batch, old, direction, eps):
    """Each transition's log-prob change with the LoRA moved by eps * direction (then back)."""
    start = [p.detach().clone() for p in worker.trainable]
    with torch.no_grad():
        for p, d in zip(worker.trainable, direction):
            p.add_(d.to(p.dtype), alpha=eps)
    new = actor_log_probs(worker, batch)
    with torch.no_grad():
        for p, s in zip(worker.trainable, start):
            p.copy_(s)
    return new - old
