"""The SDE scheduler of `rollout.options.backend=native`, set on a pipeline whose denoising
loop is not ours (diffusers' own StableDiffusion3Pipeline, FluxPipeline and QwenImagePipeline here; vLLM-Omni's
in the engine): it samples what the in-process engine samples, and the actor re-scores its
log-probs."""

import pytest
import torch

from omni.models.flux import FAMILY as FLUX
from omni.models.native import unpacked_step_noise
from omni.models.qwen_image import FAMILY as QWEN
from omni.rollout.native_scheduler import FlowGRPOScheduler
from tests.rollout.conftest import actor_log_probs, options

PROMPTS = ["a red cat", "a blue dog", "a green tree"]
SEEDS = [5, 6, 7]
CASES = {
    "flow_grpo": options(),
    "cfg_window": options(guidance_scale=3.0, sde_steps=(1, 3)),
    "cps": options(sde_type="cps", sde_steps=(0, 3)),
}


def sample_with_pipeline_loop(engine, opts, noise=unpacked_step_noise, **call):
    """diffusers' own denoising loop, our scheduler doing the steps."""
    pipe = engine.pipe
    original = pipe.scheduler
    pipe.scheduler = FlowGRPOScheduler.from_config(original.config)
    try:
        pipe.scheduler.start_rollout(SEEDS, opts, noise)
        pipe(
            prompt=PROMPTS,
            num_inference_steps=opts.num_steps,
            guidance_scale=opts.guidance_scale,
            height=opts.resolution,
            width=opts.resolution,
            max_sequence_length=opts.max_sequence_length,
            generator=[torch.Generator().manual_seed(s) for s in SEEDS],
            output_type="latent",
            **call,
        )
        return pipe.scheduler.finish_rollout()
    finally:
        pipe.scheduler = original


@pytest.mark.parametrize("case", CASES)
def test_scheduler_in_a_foreign_loop_samples_what_the_engine_samples(case, diffusers_engine):
    opts = CASES[case]
    expected = diffusers_engine.generate(PROMPTS, SEEDS, opts)
    got = sample_with_pipeline_loop(diffusers_engine, opts, negative_prompt="")
    assert torch.equal(got.sigmas, expected.sigmas)
    assert (got.latents - expected.latents).abs().max() <= 1e-5
    assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
    start, stop = opts.sde_steps
    assert torch.all(got.log_probs[:, start:stop] != 0) and torch.all(got.log_probs[:, :start] == 0)
    rescored = actor_log_probs(diffusers_engine.transformer, expected.cond, opts, got.latents, got.sigmas)
    assert (rescored - got.log_probs).abs().max() <= 1e-5


def test_flux_packed_latents_and_distilled_guidance(flux_engine):
    """FLUX.1-dev: packed latents, the resolution-shifted schedule, the guidance embedding;
    the scheduler's noise drawn as the family states (`native.noise`: unpacked, then packed),
    as the engine's is (a draw in the packed layout is other noise: the negative control)."""
    opts = options(guidance_scale=3.5, sde_steps=(1, 3))
    expected = flux_engine.generate(PROMPTS, SEEDS, opts)
    got = sample_with_pipeline_loop(flux_engine, opts, FLUX.native.noise)
    assert got.latents.shape == expected.latents.shape and got.latents.ndim == 4  # (B, T + 1, tokens, 64)
    assert torch.equal(got.sigmas, expected.sigmas)
    assert (got.latents - expected.latents).abs().max() <= 1e-5
    assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
    rescored = actor_log_probs(flux_engine.transformer, expected.cond, opts, got.latents, got.sigmas, FLUX)
    assert (rescored - got.log_probs).abs().max() <= 1e-5
    unpacked_order = sample_with_pipeline_loop(flux_engine, opts, unpacked_step_noise)
    assert (unpacked_order.latents[:, 2:] - expected.latents[:, 2:]).abs().max() > 1e-2


def test_qwen_image_true_cfg_in_its_own_loop(qwen_engine):
    """Qwen-Image: 16-channel packed latents, true CFG on " " with the norm rescale, in
    diffusers' QwenImagePipeline loop (vLLM-Omni's has the same hook points)."""
    opts = options(guidance_scale=3.0, sde_steps=(1, 3))
    expected = qwen_engine.generate(PROMPTS, SEEDS, opts)
    got = sample_with_pipeline_loop(qwen_engine, opts, QWEN.native.noise, **QWEN.pipeline_guidance(opts.guidance_scale))
    assert torch.equal(got.sigmas, expected.sigmas)
    assert (got.latents - expected.latents).abs().max() <= 1e-5
    assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
    rescored = actor_log_probs(qwen_engine.transformer, expected.cond, opts, got.latents, got.sigmas, QWEN)
    assert (rescored - got.log_probs).abs().max() <= 1e-5


def test_outside_a_rollout_it_is_the_euler_scheduler(diffusers_engine):
    base = diffusers_engine.pipe.scheduler
    ours = FlowGRPOScheduler.from_config(base.config)
    for scheduler in (base, ours):
        scheduler.set_timesteps(3)
    x, v = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    assert torch.equal(
        ours.step(v, ours.timesteps[0], x, return_dict=False)[0],
        base.step(v, base.timesteps[0], x, return_dict=False)[0],
    )


def test_a_loop_that_stops_early_is_an_error(diffusers_engine):
    scheduler = FlowGRPOScheduler.from_config(diffusers_engine.pipe.scheduler.config)
    scheduler.set_timesteps(4)
    scheduler.start_rollout([1], options())
    scheduler.step(torch.zeros(1, 4, 8, 8), scheduler.timesteps[0], torch.zeros(1, 4, 8, 8), return_dict=False)
    with pytest.raises(RuntimeError, match="took 1 scheduler steps; the rollout asked for 4"):
        scheduler.finish_rollout()
