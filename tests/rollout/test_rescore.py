"""`rescore_log_probs`: the actor's re-scoring of a rollout outside a worker (what
scripts/gpu_check_vllm.py computes the first update's importance ratios with)."""

import torch

from omni.models.sd3 import FAMILY
from omni.rollout.sampling import rescore_log_probs
from tests.rollout.conftest import LORA, options, random_lora


def test_the_sampling_weights_rescore_their_own_rollout_and_other_weights_do_not(diffusers_engine):
    opts = options(guidance_scale=3.0, sde_steps=(1, 3))
    batch = diffusers_engine.generate(["a red cat", "a blue dog"], [1, 2], opts)
    rescored = rescore_log_probs(FAMILY, diffusers_engine.transformer, batch, torch.float32)
    assert (rescored - batch.log_probs).abs().max() < 1e-5
    assert rescored[:, 0].eq(0).all() and rescored[:, 3:].eq(0).all()  # outside the window
    assert rescored[:, 1:3].abs().min() > 0
    diffusers_engine.update_weights(random_lora(diffusers_engine.transformer, seed=1), True, LORA)
    moved = rescore_log_probs(FAMILY, diffusers_engine.transformer, batch, torch.float32)
    assert (moved - batch.log_probs)[:, 1:3].abs().max() > 1e-3
