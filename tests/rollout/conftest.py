"""Helpers shared by the rollout-engine tests: sampling options, random LoRA weights and
the pipeline vLLM-Omni would build, on the tiny SD3 (the native backend's also on the tiny
FLUX, FLUX.1 Kontext with edit prompts, Qwen-Image and a tiny Wan whose heads vLLM-Omni's
rotary split takes)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from omni.config.model import LoraConfig
from omni.models.sd3 import FAMILY
from omni.rollout.base import SamplingOptions

# Where the engine env runs these tests on a machine without a GPU, vLLM-Omni must pick our
# CPU platform (omni/rollout/vllm_cpu_platform.py), before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("OMNI_VLLM_CPU", "1")

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=list(FAMILY.lora_targets))


def options(**overrides) -> SamplingOptions:
    values = dict(
        num_steps=4, resolution=64, guidance_scale=1.0, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 4)
    )
    return SamplingOptions(**{**values, **overrides})


def random_lora(transformer, seed: int = 0, lora: LoraConfig = LORA):
    """LoRA tensors (PEFT names, as collect_lora_params returns them) for `transformer`,
    non-zero so they change its outputs."""
    from peft import inject_adapter_in_model

    from omni.weights import lora_tensors, peft_lora_config

    probe = type(transformer).from_config(transformer.config)
    inject_adapter_in_model(peft_lora_config(lora), probe, adapter_name=lora.adapter_name)
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=generator) * 0.2
        for name, p in lora_tensors(probe, lora.adapter_name).items()
    }


def actor_log_probs(transformer, cond, opts: SamplingOptions, latents, sigmas, family=FAMILY) -> torch.Tensor:
    """Each SDE step's log-prob re-scored the way the actor does (`rescore_log_probs`): (B, T),
    0 outside the window."""
    from omni.rollout.base import RolloutBatch
    from omni.rollout.sampling import rescore_log_probs

    batch = RolloutBatch(
        [""] * len(latents), None, latents, torch.zeros(len(latents), opts.num_steps), sigmas, cond, opts
    )
    return rescore_log_probs(family, transformer, batch, next(transformer.parameters()).dtype)


def od_config(model_path, load_base: bool = True, dtype=torch.float32):
    """The fields of vLLM-Omni's OmniDiffusionConfig our pipeline reads."""
    return SimpleNamespace(
        model=str(model_path), dtype=dtype, custom_pipeline_args={"family": "sd3", "load_base": load_base}
    )


@pytest.fixture
def diffusers_engine(tiny_sd3_dir):
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(
        FAMILY, tiny_sd3_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=True
    )


@pytest.fixture
def flux_engine(tiny_flux_dir):
    """The in-process engine on the tiny FLUX (dev-like: distilled guidance, packed latents)."""
    from omni.models.flux import FAMILY as FLUX
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(
        FLUX, tiny_flux_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=True
    )


@pytest.fixture(scope="session")
def tiny_wan_native_dir(tmp_path_factory):
    """The tiny Wan with heads of 24 channels instead of 16: vLLM-Omni's Wan applies its
    rotary tables as diffusers does only where d // 3 is even, as for every published Wan
    (`WanNative.transformer_problem`)."""
    from diffusers import WanTransformer3DModel

    from omni.models.tiny_parts import save_pipeline
    from omni.models.wan import TINY_TRANSFORMER, build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline(seed=0)
    torch.manual_seed(0)
    pipe.transformer = WanTransformer3DModel(**{**TINY_TRANSFORMER, "attention_head_dim": 24})
    return save_pipeline(pipe, tmp_path_factory.mktemp("wan-native") / "wan")


@pytest.fixture
def wan_engine(tiny_wan_native_dir):
    """The in-process engine on that tiny Wan (5-D clip latents, CFG on the prompt "")."""
    from omni.models.wan import FAMILY as WAN
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(
        WAN, tiny_wan_native_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=True
    )


@pytest.fixture
def qwen_engine(tiny_qwen_image_dir):
    """The in-process engine on the tiny Qwen-Image (packed latents, true CFG with rescale)."""
    from omni.models.qwen_image import FAMILY as QWEN
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(
        QWEN, tiny_qwen_image_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=True
    )


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tiny_cache):
    from omni.models.flux_kontext import tiny_flux_kontext_path

    return tiny_flux_kontext_path(tiny_cache, seed=0)


@pytest.fixture
def kontext_engine(tiny_flux_kontext_dir):
    """The in-process engine on the tiny FLUX.1 Kontext (the source's latents as reference tokens)."""
    from omni.models.flux_kontext import FAMILY as KONTEXT
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(
        KONTEXT, tiny_flux_kontext_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=True
    )


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_plus_dir(tiny_cache):
    from omni.models.qwen_image_edit_plus import tiny_qwen_image_edit_plus_path

    return tiny_qwen_image_edit_plus_path(tiny_cache, seed=0)


@pytest.fixture
def qwen_edit_engine(tiny_qwen_image_edit_plus_dir):
    """The in-process engine on the tiny Qwen-Image-Edit-Plus (its sources at the pipeline's
    own areas: vLLM-Omni's pre-process sizes them so)."""
    from omni.models.qwen_image_edit_plus import FAMILY as QWEN_EDIT
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(
        QWEN_EDIT, tiny_qwen_image_edit_plus_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=True
    )


def edit_prompts(texts, directory, size: int = 64):
    """`texts` as edit prompts, each with a source image of its own (random pixels from its
    index), `size` square, written to `directory`."""
    from PIL import Image

    from omni.data.prompts import Prompt

    prompts = []
    for i, text in enumerate(texts):
        pixels = torch.randint(0, 256, (size, size, 3), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
        path = directory / f"source{i}.png"
        Image.fromarray(pixels.numpy()).save(path)
        prompts.append(Prompt(text, images=[str(path)], origin=f"{path.name}"))
    return prompts
