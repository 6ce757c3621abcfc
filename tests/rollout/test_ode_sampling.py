"""The ODE solver inside the rollout sampler, on the tiny SD3 (in-process diffusers engine):
MixGRPO-Flash's dpm2 changes only the ODE steps that have an ODE step before them, and the
stored trajectory is the one the SDE steps' log-probs were drawn on."""

import torch

from omni.models.sd3 import FAMILY
from omni.rollout.sde import sde_step
from tests.rollout.conftest import options

PROMPTS, SEEDS = ["a red cat", "a blue dog"], [3, 4]


def sample(engine, **overrides):
    return engine.generate(PROMPTS, SEEDS, options(num_steps=6, **overrides))


def test_dpm2_changes_only_the_ode_steps_after_the_window(diffusers_engine):
    """Window [0, 2): the SDE steps start from the same noise, so their latents and log-probs
    are the solver's to leave alone; step 2, the first ODE step after the SDE, is first order
    (no history), so it is Euler's; step 3 is the first second-order step. ODE steps score 0."""
    euler, dpm2 = (
        sample(diffusers_engine, sde_steps=(0, 2)),
        sample(diffusers_engine, sde_steps=(0, 2), ode_solver="dpm2"),
    )
    assert torch.equal(dpm2.log_probs[:, :2], euler.log_probs[:, :2]) and torch.all(dpm2.log_probs[:, :2] != 0)
    assert torch.all(dpm2.log_probs[:, 2:] == 0) and torch.all(euler.log_probs[:, 2:] == 0)
    assert torch.equal(dpm2.latents[:, :4], euler.latents[:, :4])
    assert (dpm2.latents[:, 4] - euler.latents[:, 4]).abs().max() > 1e-4
    assert not torch.equal(dpm2.images, euler.images)


def test_the_solver_does_not_matter_without_a_second_order_step(diffusers_engine):
    """Window [2, 4) of 6, where each ODE step is first order (step 0 has no history, step 1's
    history is at sigma 1, step 4 follows an SDE step, step 5 lands on sigma 0): euler and dpm2
    give the same rollout, bit for bit. The default solver is euler."""
    assert options().ode_solver == "euler"
    euler = sample(diffusers_engine, sde_steps=(2, 4))
    assert torch.equal(sample(diffusers_engine, sde_steps=(2, 4), ode_solver="dpm2").latents, euler.latents)


def test_stored_window_rescores_to_its_log_probs(diffusers_engine):
    """Window [3, 5) after three dpm2 ODE steps: re-scoring each stored SDE transition as the
    actor does (the velocity at the stored latent, the SDE step's density at the stored next
    latent) gives the sampler's log-prob, so the update sees what the sampler did."""
    batch = sample(diffusers_engine, sde_steps=(3, 5), ode_solver="dpm2")
    pipe = diffusers_engine.pipe
    for i in (3, 4):
        sigma = batch.sigmas[i].expand(len(PROMPTS))
        with torch.no_grad():
            velocity = FAMILY.predict_velocity(pipe.transformer, batch.latents[:, i], sigma, batch.cond, 1.0)
        _, log_prob, _, _ = sde_step(
            velocity,
            batch.latents[:, i],
            batch.sigmas[i],
            batch.sigmas[i + 1],
            float(batch.sigmas[1]),
            0.7,
            next_sample=batch.latents[:, i + 1],
        )
        assert (log_prob - batch.log_probs[:, i]).abs().max() < 1e-5
