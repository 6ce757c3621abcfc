"""What the native backend's requests carry for each family's guidance: vLLM-Omni's
Qwen-Image runs true CFG only for a request with a negative prompt, at the request's
`true_cfg_scale` (its real pipeline reads them: tests/rollout/test_vllm_native_contract.py)."""

from omni.models.qwen_image import NEGATIVE_PROMPT
from omni.rollout.native_support import request_guidance


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
