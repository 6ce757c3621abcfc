"""Encoding images by inverting the VAE's decoder (`model.vae_inversion_steps`), which a tiny
random VAE needs: its encoder's latents decode to images unrelated to the input."""

import pytest
import torch

from omni.data.synthetic_pairs import BRIGHTNESS_GAP, _smooth
from omni.models.base import vae_decode, vae_encode


@pytest.fixture(scope="module")
def vae(tiny_sd3_dir):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(tiny_sd3_dir, subfolder="vae")


def _lighter_and_darker(n: int) -> torch.Tensor:
    """n smooth images, each once lighter and once darker (as the synthetic pairs are)."""
    image = 0.3 + 0.4 * _smooth(torch.rand(n, 3, 4, 4, generator=torch.Generator().manual_seed(0)), 64)
    return torch.cat([image + BRIGHTNESS_GAP, image - BRIGHTNESS_GAP])


def test_inverted_latents_decode_to_the_image_the_encoders_do_not(vae):
    images = _lighter_and_darker(2)
    inverted = vae_encode(vae, images, "cpu", inversion_steps=100)
    encoded = vae_encode(vae, images, "cpu")
    assert inverted.shape == encoded.shape == (4, vae.config.latent_channels, 8, 8)
    error = {
        name: (vae_decode(vae, z) - images).pow(2).mean().item()
        for name, z in [("inverted", inverted), ("encoded", encoded)]
    }
    assert error["inverted"] < 0.5 * error["encoded"], error
    brightness = vae_decode(vae, inverted).mean(dim=(1, 2, 3))
    # the lighter image stays clearly the lighter (its gap is 0.2; the decoder's range is narrower)
    assert (brightness[:2] - brightness[2:] > 0.04).all(), brightness


def test_inversion_is_deterministic_and_leaves_the_vae_as_it_was(vae):
    images = _lighter_and_darker(1)
    before = {name: (p.clone(), p.requires_grad) for name, p in vae.named_parameters()}
    first, second = (vae_encode(vae, images, "cpu", inversion_steps=5) for _ in range(2))
    assert torch.equal(first, second)
    assert all(torch.equal(p, before[n][0]) and p.requires_grad == before[n][1] for n, p in vae.named_parameters())
    assert all(p.grad is None for p in vae.parameters())
