"""Which families the native backend serves (those that state their facts,
`ModelFamily.native`), and what its requests carry for each family's guidance: vLLM-Omni's
Qwen-Image runs true CFG only for a request with a negative prompt, at the request's
`true_cfg_scale` (its real pipeline reads them: tests/rollout/test_vllm_native_contract.py)."""

import pytest

from omni.models.qwen_image import NEGATIVE_PROMPT
from omni.rollout.native_support import (
    family_problem,
    native_facts,
    native_families,
    native_pipeline_class,
    request_guidance,
)


def test_the_served_families_are_those_that_state_their_facts():
    assert native_families() == ["flux", "flux_kontext", "qwen_image", "qwen_image_edit_plus", "sd3", "wan"]
    assert native_pipeline_class("flux_kontext") == "omni.rollout.vllm_native.NativeFluxKontextPipeline"
    assert native_pipeline_class("sd3") == "omni.rollout.vllm_native.NativeStableDiffusion3Pipeline"
    assert native_pipeline_class("qwen_image") == "omni.rollout.vllm_native.NativeQwenImagePipeline"
    assert all(family_problem(f) is None for f in native_families())
    assert native_pipeline_class("wan") == "omni.rollout.vllm_native.NativeWan22Pipeline"
    # Wan2.2 A14B: vLLM-Omni's Wan pipeline runs both experts, the native backend not yet
    assert "vLLM-Omni has a Wan22Pipeline but omni-recipes does not extend it yet" in family_problem("wan22")
    assert "or use rollout.options.backend=vllm" in family_problem("no_such_family")
    with pytest.raises(KeyError, match="model.family=wan22"):
        native_facts("wan22")


def test_qwen_image_requests_carry_the_negative_prompt_and_scale_under_cfg():
    assert request_guidance("qwen_image", 4.5) == ({"negative_prompt": NEGATIVE_PROMPT}, {"true_cfg_scale": 4.5})


def test_no_negative_prompt_without_a_second_pass():
    """A scale of 1 (or 0, which vLLM-Omni would read as 4) samples without CFG, as the actor does."""
    for scale in (1.0, 0.0):
        prompt, _ = request_guidance("qwen_image", scale)
        assert prompt == {}


def test_sd3_and_flux_take_the_guidance_scale_only():
    assert request_guidance("sd3", 3.0) == ({}, {"guidance_scale": 3.0})
    assert request_guidance("flux", 3.5) == ({}, {"guidance_scale": 3.5})
