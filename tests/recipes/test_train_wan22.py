"""The real CLI on the tiny two-expert Wan2.2: two steps train both experts' LoRA and export
files a plain `WanPipeline` loads into its two transformers."""

import logging

import pytest
import torch
from peft.utils import get_peft_model_state_dict

from tests.recipes.test_train import train


@pytest.mark.slow
def test_two_steps_train_both_experts_and_export_what_wan_pipeline_loads(tmp_path, tiny_cache):
    from diffusers import WanPipeline

    from omni.models.wan22 import FAMILY, load_both_experts

    run_dir = tmp_path / "run"
    train(run_dir, tiny_cache, "model=wan22_tiny", "reward=frame_brightness", "trainer.steps=2")
    step = run_dir / "checkpoints" / "step_000002"
    lora = FAMILY.load_lora(step)
    for expert in FAMILY.experts:
        b = [v for k, v in lora.items() if k.startswith(f"{expert}.") and ".lora_B." in k]
        assert b and any(v.abs().max() > 0 for v in b), f"{expert}: its LoRA did not train"

    plain = WanPipeline.from_pretrained(str(FAMILY.tiny_path(tiny_cache, 0)), local_files_only=True)
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("diffusers").addHandler(handler)
    try:
        load_both_experts(plain, step, "trained")
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert not [m for m in messages if "unexpected keys" in m or "missing keys" in m]
    for expert, module in zip(FAMILY.experts, (plain.transformer, plain.transformer_2)):
        loaded = get_peft_model_state_dict(module, adapter_name="trained")
        ours = {k[len(expert) + 1 :]: v for k, v in lora.items() if k.startswith(f"{expert}.")}
        assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k].to(loaded[k].dtype)) for k in ours)
