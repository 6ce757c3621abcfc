"""What is FLUX's own beyond the family contract (tests/models/test_family_contract.py): packed
latents as FluxPipeline packs them, our sampler's ODE images equal to `FluxPipeline.__call__`'s
for schnell (no guidance embedding), the distilled guidance reaching the transformer, the
resolution-dependent shift, and FLUX.1's published VAE and schedulers."""

import pytest
import torch

from omni.models import get_family
from omni.models.flux import FAMILY, image_ids, pack, tiny_flux_path, unpack, write_tiny_flux
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout

PROMPTS = ["a red cat", "a blue dog"]


def load(path):
    pipe = FAMILY.load_pipeline(path, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def dev(tiny_flux_dir):
    return load(tiny_flux_dir)


@pytest.fixture(scope="module")
def schnell(tmp_path_factory):
    return load(write_tiny_flux(tmp_path_factory.mktemp("schnell") / "flux", seed=0, guidance_embeds=False))


def test_family_and_cache(tiny_cache, tiny_flux_dir):
    assert get_family("flux") is FAMILY
    assert tiny_flux_path(tiny_cache, seed=0) == tiny_flux_dir
    assert FAMILY.tiny_resolution_multiple() == FAMILY.resolution_multiple(tiny_flux_dir) == 16


def test_packing_is_flux_pipelines(tiny_flux_dir):
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 8, 8)
    packed = pack(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 8))
    assert torch.equal(unpack(packed), FluxPipeline._unpack_latents(packed, 64, 64, 8))
    assert torch.equal(unpack(packed), latents)
    assert torch.equal(
        image_ids(16, "cpu", torch.float32), FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
    )


def ode_sample(pipe, guidance_scale, steps=4):
    """Our sampler with every step an ODE step."""
    options = SamplingOptions(steps, 64, guidance_scale, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 0))
    return sample_rollout(FAMILY, pipe, PROMPTS, [3, 4], options, 4, torch.device("cpu"), torch.float32)


def test_ode_sampling_equals_flux_pipeline_without_a_guidance_embedding(schnell):
    """schnell (no guidance embedding): the family contract checks dev, the tiny default."""
    pipe, guidance_scale = schnell, 0.0
    ours = ode_sample(pipe, guidance_scale)
    theirs = pipe(
        PROMPTS, height=64, width=64, num_inference_steps=4, guidance_scale=guidance_scale, max_sequence_length=16,
        latents=ours.latents[:, 0].clone(), output_type="pt",
    ).images  # fmt: skip
    assert ours.latents.shape == (2, 5, 16, 64) and theirs.std() > 0.05
    assert (ours.images - theirs).abs().max() < 1e-5
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    # the initial latents are FluxPipeline's for the same generators
    assert torch.equal(ours.latents[:, 0], pipe.prepare_latents(2, 16, 64, 64, torch.float32, "cpu", generators)[0])


def test_distilled_guidance_reaches_the_transformer(dev):
    low, high = ode_sample(dev, guidance_scale=1.0), ode_sample(dev, guidance_scale=3.5)
    assert (low.images - high.images).abs().max() > 1e-2


def test_shift_grows_with_the_resolution(dev, schnell):
    """FLUX.1-dev's dynamic shift (mu from the image's token count) raises the noise levels
    of larger images; schnell's schedule is unshifted."""
    small, large = FAMILY.sigmas(dev, 4, 64), FAMILY.sigmas(dev, 4, 1024)
    assert small[0] == large[0] == 1 and small[-1] == large[-1] == 0
    assert torch.all(large[1:-1] > small[1:-1] + 0.01)
    assert torch.allclose(FAMILY.sigmas(schnell, 4, 1024), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


def test_published_vae_and_schedulers():
    """FLUX.1's shipped VAE config is the family's VAE (its weight count; 16 channels, four per
    packed token of the published transformers); dev's scheduler shifts with the resolution,
    schnell's does not."""
    import json
    from importlib import resources

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    from omni.memory import arch_config

    with torch.device("meta"):
        vae = AutoencoderKL.from_config(
            json.loads((resources.files("omni") / "models" / "configs" / FAMILY.published_vae_config).read_text())
        )
    assert sum(p.numel() for p in vae.parameters()) == FAMILY.vae_params and vae.config.shift_factor == 0.1159
    dev_config, schnell_config = arch_config(FAMILY, "flux.1-dev"), arch_config(FAMILY, "flux.1-schnell")
    assert vae.config.latent_channels * 4 == dev_config["in_channels"] == schnell_config["in_channels"]
    dev, schnell = (
        FlowMatchEulerDiscreteScheduler.from_config(FAMILY.published_scheduler_config(c))
        for c in (dev_config, schnell_config)
    )
    assert dev.config.use_dynamic_shifting and not schnell.config.use_dynamic_shifting
