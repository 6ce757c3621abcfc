"""What every family's slow CLI test checks after `recipes/train.py` ran two steps: the run's
exported LoRA loads with the family's pipeline `load_lora_weights`, moves its velocity, and
gives the velocity of the same LoRA loaded into our transformer."""

import torch

from omni.config.model import LoraConfig
from omni.weights import add_lora_adapter, load_lora_weights
from tests.recipes.test_train import final_lora


def assert_exported_lora_matches(family, tiny_dir, run_dir, prompts, latents: torch.Tensor, guidance: float = 4.0):
    pipe = family.load_pipeline(tiny_dir, torch.float32)
    cond = family.encode_prompts(pipe, list(prompts), guidance, 16, "cpu")
    sigmas = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        base = family.predict_velocity(pipe.transformer, latents, sigmas, cond, guidance)
        pipe.load_lora_weights(str(run_dir / "checkpoints" / "step_000002"))
        loaded = family.predict_velocity(pipe.transformer, latents, sigmas, cond, guidance)
        reference = family.load_transformer(tiny_dir, torch.float32)
        add_lora_adapter(reference, LoraConfig(target_modules=list(family.lora_targets)))
        lora = {k.removeprefix("transformer."): v for k, v in final_lora(run_dir, 2).items()}
        assert all(any(k.startswith(prefix) for k in lora) for prefix in family.layer_prefixes)
        load_lora_weights(reference, lora, "default")
        expected = family.predict_velocity(reference, latents, sigmas, cond, guidance)
    assert (base - loaded).abs().max() > 1e-6
    assert torch.allclose(loaded, expected, atol=1e-6)
