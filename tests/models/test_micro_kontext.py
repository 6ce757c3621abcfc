"""The shipped micro FLUX.1 Kontext (omni/assets/micro_kontext, `model=micro_kontext`): it
loads offline through the config and samples a 64 px edit with the recipes' sampler; the
script that pretrained it (scripts/pretrain_micro_kontext.py) conditions exactly as a
rollout does and still takes the first steps it took, so the weights stay reproducible
from the script."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config
from tests.script_modules import load_script

ASSET = Path(__file__).resolve().parents[2] / "omni" / "assets" / "micro_kontext"
needs_weights = pytest.mark.skipif(
    not (ASSET / "model_index.json").is_file(), reason="no micro_kontext weights shipped"
)

# One thread, seed 0: the first transformer steps on a 64-edit pool (a full run's pool is
# 4,096 edits; the same edits come first, only the batches drawn from them differ).
TRANSFORMER_LOSSES = [2.6161510944366455, 2.685976028442383, 2.6720993518829346]


def test_transformer_first_steps_are_pinned(one_thread):
    script = load_script("pretrain_micro_kontext")
    args = script.parse_args(["unused", "--steps", "3", "--pool", "64"])
    pipe, pool, _ = script.prepare(args)
    losses = script.train_transformer(pipe, pool, args)
    assert losses == pytest.approx(TRANSFORMER_LOSSES, rel=1e-5)


def test_pretraining_conditions_as_a_rollout_does(tmp_path):
    """The pool's source latents and text embeddings for an edit are what the family's
    `encode_prompts` gives for the same edit read from a PNG, as a rollout reads it; the
    4-channel VAE's latents pack into 16-wide tokens and unpack back."""
    from omni.data.prompts import Prompt
    from omni.models.packing import pack, unpack
    from omni.recolor import to_png

    script = load_script("pretrain_micro_kontext")
    pipe = script.micro_kontext_pipeline(0)
    edits = script.pool_edits(2, seed=0)
    targets, sources, text, embeds, pooled = script.latent_pool(pipe, edits)
    prompts = []
    for i, (instruction, source, _) in enumerate(edits):
        to_png(source, tmp_path / f"{i}.png")
        prompts.append(Prompt(instruction, {}, f"edit {i}", [str(tmp_path / f"{i}.png")]))
    cond = script.FAMILY.encode_prompts(pipe, prompts, script.GUIDANCE, script.TEXT_LENGTH, torch.device("cpu"))
    assert torch.equal(cond.source, sources)
    assert torch.allclose(cond.embeds, embeds[text]) and torch.allclose(cond.pooled, pooled[text])
    assert sources.shape == (2, 4, 16, 16) and targets.shape == (2, 64, 16)
    assert torch.equal(pack(unpack(targets)), targets)
    script.save_pipeline(pipe, tmp_path / "pipe")
    assert script.FAMILY.resolution_multiple(tmp_path / "pipe") == 8  # the VAE's factor 4 times the 2x2 packing


@needs_weights
def test_shipped_weights_match_the_script_and_stay_small():
    script = load_script("pretrain_micro_kontext")
    shipped = json.loads((ASSET / "transformer" / "config.json").read_text())
    assert {k: shipped[k] for k in script.TRANSFORMER if k != "axes_dims_rope"} == {
        k: v for k, v in script.TRANSFORMER.items() if k != "axes_dims_rope"
    }
    assert sum(p.stat().st_size for p in ASSET.rglob("*.safetensors")) <= 15 * 2**20


@needs_weights
def test_model_micro_kontext_loads_offline_and_samples_a_64px_edit(monkeypatch):
    from omni.data.prompt_sets import load_prompt_set
    from omni.models import get_family
    from omni.rollout.base import SamplingOptions
    from omni.rollout.sampling import sample_rollout

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_config(["model=micro_kontext"])
    assert Path(cfg.model.path).resolve() == ASSET.resolve()
    family = get_family(cfg.model.family)
    family.check_path(cfg.model.path)
    assert family.resolution_multiple(cfg.model.path) == 8  # the VAE's factor 4 times the 2x2 packing
    pipe = family.load_pipeline(cfg.model.path, torch.float32)
    edit = load_prompt_set("omni:recolor_eval", "data.eval")[:1]
    options = SamplingOptions(
        num_steps=2,
        resolution=cfg.model.resolution,
        guidance_scale=cfg.model.guidance_scale,
        noise_level=0.7,
        max_sequence_length=cfg.model.max_sequence_length,
        sde_steps=(0, 0),
    )
    batch = sample_rollout(family, pipe, edit, [0], options, 1, torch.device("cpu"), torch.float32)
    assert batch.images.shape == (1, 3, 64, 64) and torch.isfinite(batch.images).all()
    assert batch.latents.shape[-2:] == (64, 16)  # 8 x 8 tokens of 4 channels x 2 x 2
