"""The real CLI on the tiny Qwen-Image: a short Flow-GRPO run whose exported LoRA loads with
`QwenImagePipeline.load_lora_weights` and changes its output, and bad input that fails before
any model loads."""

import pytest
import torch

from tests.recipes.test_train import final_lora, train

SHORT = [
    "model=qwen_image_tiny", "trainer.steps=2", "trainer.batch_size=8", "algorithm.group_size=4",
    "rollout.num_steps=4", "eval.images_per_prompt=1",
]  # fmt: skip


@pytest.mark.slow
def test_qwen_image_run_exports_a_lora_the_pipeline_loads(tmp_path, tiny_cache, tiny_qwen_image_dir):
    from omni.config.model import LoraConfig
    from omni.models.qwen_image import FAMILY
    from omni.weights import add_lora_adapter, load_lora_weights

    train(tmp_path / "run", tiny_cache, *SHORT)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    pipe = FAMILY.load_pipeline(tiny_qwen_image_dir, torch.float32)
    cond = FAMILY.encode_prompts(pipe, ["a red cat", "a blue dog"], 4.0, 16, "cpu")
    latents = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        base = FAMILY.predict_velocity(pipe.transformer, latents, sigmas, cond, 4.0)
        pipe.load_lora_weights(str(checkpoint))
        loaded = FAMILY.predict_velocity(pipe.transformer, latents, sigmas, cond, 4.0)
        # the same tensors in the actor's own format, with the run's LoRA config: no LoRA on
        # the last block's text output, which the transformer never returns
        unused = FAMILY.unused_modules(FAMILY.tiny_transformer_config())
        reference = FAMILY.load_transformer(tiny_qwen_image_dir, torch.float32)
        add_lora_adapter(reference, LoraConfig(target_modules=list(FAMILY.lora_targets), exclude_modules=unused))
        peft_names = {k.removeprefix("transformer."): v for k, v in final_lora(tmp_path / "run", 2).items()}
        assert any(".add_q_proj." in k for k in peft_names)
        assert "transformer_blocks.1.attn.to_add_out" in unused
        assert not any(k.startswith(f"{name}.") for k in peft_names for name in unused)
        load_lora_weights(reference, peft_names, "default")
        expected = FAMILY.predict_velocity(reference, latents, sigmas, cond, 4.0)
    assert (base - loaded).abs().max() > 1e-6
    assert torch.allclose(loaded, expected, atol=1e-6)


@pytest.mark.slow  # tests/config/test_validate.py checks the same rules in-process, in the fast lane
def test_bad_qwen_image_resolution_fails_before_loading(tmp_path, tiny_cache):
    result = train(tmp_path / "bad", tiny_cache, "model=qwen_image_tiny", "rollout.resolution=72", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "rollout.resolution=72: this model takes multiples of 16" in output
    assert "Loading pipeline components" not in output
