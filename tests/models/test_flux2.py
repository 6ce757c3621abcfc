"""What is FLUX.2 [klein]'s own beyond the family contract (tests/models/test_family_contract.py):
its guidance (classifier-free above a scale of 1 for the base, none for a distilled checkpoint,
which validation refuses to guide), its latent layout (patchified, batch-normalised, packed row
by row) against the pipeline's own helpers, with unnormalised latents as a negative control, the
published architecture's size, and (slow) a short run of the real CLI whose exported LoRA
`Flux2KleinPipeline.load_lora_weights` loads."""

import json
from importlib import resources

import pytest
import torch

from omni.models import get_family
from omni.models.flux2 import (
    FAMILY,
    pack_tokens,
    patchify,
    tiny_flux2_path,
    unpack_tokens,
    unpatchify,
    write_tiny_flux2,
)
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout

PROMPTS = ("a red cat", "a blue dog with a tree")
SEEDS = (3, 4)


@pytest.fixture(scope="module")
def tiny_dir(tiny_cache):
    return tiny_flux2_path(tiny_cache, seed=0)


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    pipe = FAMILY.load_pipeline(tiny_dir, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ode_sample(pipe, guidance_scale):
    options = SamplingOptions(3, 64, guidance_scale, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 0))
    return sample_rollout(FAMILY, pipe, list(PROMPTS), list(SEEDS), options, 4, torch.device("cpu"), torch.float32)


def pipeline_images(pipe, guidance_scale):
    return pipe(
        prompt=list(PROMPTS), height=64, width=64, num_inference_steps=3, max_sequence_length=16,
        guidance_scale=guidance_scale, generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="pt",
    ).images  # fmt: skip


def test_family_and_cache(tiny_cache, tiny_dir):
    assert get_family("flux2") is FAMILY
    assert tiny_flux2_path(tiny_cache, seed=0) == tiny_dir
    assert FAMILY.resolution_multiple(tiny_dir) == 16


def test_guidance_is_classifier_free_above_one(pipe, monkeypatch):
    """1 is one pass (no negative prompt); 1.5 already guides; 4 is the pipeline's
    neg + s (pos - neg), which Z-Image's form pos + s (pos - neg) does not reproduce."""
    assert FAMILY.forward_passes(1.0) == 1 and FAMILY.forward_passes(1.5) == 2
    one, half = ode_sample(pipe, 1.0), ode_sample(pipe, 1.5)
    assert one.cond.neg_embeds is None and half.cond.neg_embeds is not None
    assert (one.images - half.images).abs().max() > 1e-4
    theirs = pipeline_images(pipe, 4.0)
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() < 1e-5
    monkeypatch.setattr(FAMILY, "guide", lambda text, uncond, scale: text + scale * (text - uncond))
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() > 1e-4


def test_a_distilled_checkpoint_is_not_guided(tmp_path):
    """The distilled pipeline ignores the scale; validation refuses a scale above 1 for it,
    naming the key, and takes 1 (and any scale for the base checkpoint)."""
    from omni.config.errors import ConfigError
    from omni.validation import validate
    from tests.conftest import compose_config

    path = write_tiny_flux2(tmp_path / "distilled", seed=0, distilled=True)
    distilled = FAMILY.load_pipeline(path, torch.float32)
    distilled.set_progress_bar_config(disable=True)
    assert torch.equal(pipeline_images(distilled, 4.0), pipeline_images(distilled, 1.0))
    overrides = ["model=flux2_klein", f"model.path={path}", "model.resolution=64", "model.max_sequence_length=16"]
    with pytest.raises(ConfigError, match=r"rollout.guidance_scale=4.0.*is_distilled.*model.guidance_scale=1.0"):
        validate(compose_config([*overrides, "model.guidance_scale=4.0"]))
    validate(compose_config(overrides))
    base = write_tiny_flux2(tmp_path / "base", seed=0)
    validate(compose_config(["model=flux2_klein_base", f"model.path={base}", *overrides[2:]]))


def test_latent_layout_is_the_pipelines(pipe):
    """Patchify, pack and their inverses agree with Flux2KleinPipeline's helpers (the token
    layout is FLUX.1's `pack`); encoded images are the pipeline's reference-image latents,
    packed: batch-normalised, which the posterior's mode packed as FLUX.1 does is not."""
    from omni.models.packing import pack

    cls = type(pipe)
    vae_latents = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(0))
    patched = patchify(vae_latents)
    assert torch.equal(patched, cls._patchify_latents(vae_latents)) and torch.equal(unpatchify(patched), vae_latents)
    tokens = pack_tokens(patched)
    assert torch.equal(tokens, cls._pack_latents(patched))
    ids = cls._prepare_latent_ids(patched)
    assert torch.equal(unpack_tokens(tokens, 4), cls._unpack_latents_with_ids(tokens, ids, 4, 4))
    assert torch.equal(pack(vae_latents), tokens)

    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = pack_tokens(pipe._encode_vae_image(images * 2 - 1, generator=None))
        unnormalised = pack(pipe.vae.encode(images * 2 - 1).latent_dist.mode())
    ours = FAMILY.encode_images(pipe, images, "cpu")
    assert torch.allclose(ours, theirs, atol=1e-6) and (ours - unnormalised).abs().max() > 0.1


def test_decoder_inversion_recovers_decodable_latents(pipe):
    """With inversion steps, the latents decode closer to the images than zero latents do."""
    target = FAMILY.decode(pipe, torch.randn(1, 16, 128, generator=torch.Generator().manual_seed(2)), 64)
    inverted = FAMILY.encode_images(pipe, target, "cpu", inversion_steps=20)
    assert inverted.shape == (1, 16, 128)
    start = (FAMILY.decode(pipe, torch.zeros_like(inverted), 64) - target).square().mean()
    assert (FAMILY.decode(pipe, inverted, 64) - target).square().mean() < 0.5 * start


def test_published_architecture_and_scheduler():
    """FLUX.2-klein-4B's transformer is 3.88B parameters (5 double-, 20 single-stream blocks,
    128 latent channels, no guidance embedding); the VAE config is the 32-channel one whose
    size the family declares; the scheduler shifts dynamically."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    from omni.memory import arch_config

    config = arch_config(FAMILY, "flux.2-klein-4b")
    count = sum(p.numel() for p in FAMILY.meta_transformer(config=config).parameters())
    assert round(count / 1e9, 2) == 3.88 and not config["guidance_embeds"] and config["in_channels"] == 128
    vae_config = json.loads((resources.files("omni") / "models" / "configs" / FAMILY.published_vae_config).read_text())
    with torch.device("meta"):
        vae = AutoencoderKLFlux2.from_config(vae_config)
    assert sum(p.numel() for p in vae.parameters()) == FAMILY.vae_params and vae.config.latent_channels == 32
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FAMILY.published_scheduler_config(config))
    assert scheduler.config.use_dynamic_shifting
    assert FAMILY.sequence_length(config, 1024, 512) == 64 * 64 + 512


@pytest.mark.slow
def test_train_cli_exports_a_lora_the_pipeline_loads(tmp_path, tiny_cache, tiny_dir):
    """`recipes/train.py model=flux2_klein_tiny` for two Flow-GRPO steps; the checkpoint's LoRA
    loads with Flux2KleinPipeline.load_lora_weights and gives its transformer the velocity of
    the run's LoRA loaded into ours."""
    from tests.models.cli_lora import assert_exported_lora_matches
    from tests.recipes.test_train import train

    train(
        tmp_path / "run", tiny_cache, "model=flux2_klein_tiny", "trainer.steps=2", "trainer.batch_size=8",
        "algorithm.group_size=4", "rollout.num_steps=4", "eval.images_per_prompt=1",
    )  # fmt: skip
    latents = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(0))
    assert_exported_lora_matches(FAMILY, tiny_dir, tmp_path / "run", PROMPTS, latents)
