"""The shipped micro SD3 (omni/assets/micro, `model=micro`): it loads offline through the
config like any local checkpoint and samples a 64 px image, and the script that trained it
(scripts/pretrain_micro.py) still takes the first steps it took, so the weights stay
reproducible from the script."""

from pathlib import Path

import pytest
import torch

from tests.conftest import compose_config
from tests.script_modules import load_script

ASSET = Path(__file__).resolve().parents[2] / "omni" / "assets" / "micro"
# An installation without the weights (a trimmed wheel) skips the tests that load them.
needs_weights = pytest.mark.skipif(not (ASSET / "model_index.json").is_file(), reason="no micro weights shipped")

# One thread, seed 0: the first VAE steps, and the first transformer steps on a 256-render
# pool encoded by the VAE after those 3 steps (a full run's pool is 8,192 renders; the same
# renders come first, only the batches drawn from them differ).
VAE_LOSSES = [0.22531758248806, 0.11675979197025299, 0.08705490082502365]
TRANSFORMER_LOSSES = [2.2306392192840576, 2.2341933250427246, 2.2245566844940186]


def test_vae_first_steps_are_pinned(one_thread):
    script = load_script("pretrain_micro")
    args = script.parse_args(["unused", "--vae-steps", "3"])
    pipe = script.micro_pipeline(args.seed)
    losses = script.train_vae(pipe.vae, script.scenes.training_prompts(4096, args.seed), args)
    assert losses == pytest.approx(VAE_LOSSES, rel=1e-5)


def test_transformer_first_steps_are_pinned(one_thread):
    script = load_script("pretrain_micro")
    args = script.parse_args(["unused", "--vae-steps", "3", "--steps", "3", "--pool", "256"])
    pipe, pool, _ = script.prepare(args)
    losses = script.train_transformer(pipe, pool, args)
    assert losses == pytest.approx(TRANSFORMER_LOSSES, rel=1e-5)


@needs_weights
def test_shipped_weights_match_the_script_and_stay_small():
    script = load_script("pretrain_micro")
    config = script.micro_pipeline(0).transformer.config
    shipped = __import__("json").loads((ASSET / "transformer" / "config.json").read_text())
    assert {k: shipped[k] for k in script.TRANSFORMER} == {k: config[k] for k in script.TRANSFORMER}
    assert sum(p.stat().st_size for p in ASSET.rglob("*.safetensors")) <= 30 * 2**20


@needs_weights
def test_model_micro_loads_offline_and_samples_64px(monkeypatch):
    from omni.models import get_family

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose_config(["model=micro"])
    assert Path(cfg.model.path) == ASSET.resolve() or Path(cfg.model.path).resolve() == ASSET.resolve()
    family = get_family(cfg.model.family)
    family.check_path(cfg.model.path)
    pipe = family.load_pipeline(cfg.model.path, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt="a photo of a red circle",
        num_inference_steps=2,
        guidance_scale=cfg.model.guidance_scale,
        height=cfg.model.resolution,
        width=cfg.model.resolution,
        max_sequence_length=cfg.model.max_sequence_length,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


def test_unknown_asset_names_what_ships():
    from omni.models.assets import asset_path

    with pytest.raises(FileNotFoundError, match="no checkpoint nothing-here"):
        asset_path("nothing-here")
