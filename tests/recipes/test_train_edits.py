"""Edit families through the CLI on the recolour edits (two steps each, the tiny FLUX.1
Kontext): Flow-GRPO on `data=recolor` exports a LoRA that FluxKontextPipeline loads and
runs as our actor does; offline DPO trains on edit pairs (`image`, `chosen`, `rejected`)."""

import pytest
import torch

from omni.data.prompt_sets import load_prompt_set
from omni.models.flux_kontext import FAMILY
from omni.recolor import write_recolor_pairs
from tests.models.cli_lora import assert_exported_lora_matches
from tests.recipes.test_train import train

EDIT = ["model=flux_kontext_tiny", "data=recolor", "reward=edit", "eval.max_images=8", "trainer.steps=2"]


@pytest.mark.slow
def test_flow_grpo_on_edits_exports_a_lora_the_kontext_pipeline_loads(tmp_path, tiny_cache):
    run = tmp_path / "grpo"
    train(run, tiny_cache, *EDIT, "algorithm=flow_grpo", "trainer.batch_size=8", "algorithm.group_size=4")
    edits = load_prompt_set("omni:recolor_eval")[:2]
    latents = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))  # 64 px: 4 x 4 packed tokens
    assert_exported_lora_matches(FAMILY, FAMILY.tiny_path(tiny_cache, 0), run, edits, latents, guidance=2.5)


@pytest.mark.slow
def test_offline_dpo_trains_on_edit_pairs(tmp_path, tiny_cache):
    pairs = write_recolor_pairs(tmp_path / "data", "pairs", 8, seed=5)
    run = tmp_path / "dpo"
    result = train(
        run, tiny_cache, *EDIT, "algorithm=dpo", "data.pairs=" + str(pairs), "data.pairs_eval_fraction=0.25",
        "model.vae_inversion_steps=2", "trainer.batch_size=4", "trainer.micro_batch_size=4",
    )  # fmt: skip
    assert "eval/implicit_accuracy" in result.stdout + result.stderr
    assert (run / "checkpoints" / "step_000002" / "pytorch_lora_weights.safetensors").is_file()
