"""The facts a family states for `rollout.options.backend=native` (`omni.models.native`):
the timestep it gives vLLM-Omni's transformer is the one its actor gives its own, bit for
bit (a transformer that records its timestep stands in for both), and a packed family's
step noise is its initial latents' draw."""

from types import SimpleNamespace

import pytest
import torch

from omni.models import get_family
from omni.models.native import packed_step_noise, unpacked_step_noise
from omni.rollout.native_support import native_families

B, TOKENS, WIDTH = 2, 16, 8
CONDITIONING = {  # one batch of each family's conditioning fields
    "sd3": lambda: (torch.randn(B, 5, 4), torch.randn(B, 4)),
    "flux": lambda: (torch.randn(B, 5, 4), torch.randn(B, 4)),
    "qwen_image": lambda: (torch.randn(B, 5, 4), torch.ones(B, 5, dtype=torch.long)),
    "wan": lambda: (torch.randn(B, 5, 4), None),
}
LATENTS = {"sd3": (B, 4, 4, 4), "flux": (B, TOKENS, WIDTH), "qwen_image": (B, TOKENS, WIDTH), "wan": (B, 4, 2, 4, 4)}


class RecordingTransformer(torch.nn.Module):
    config = SimpleNamespace(guidance_embeds=False)

    def forward(self, hidden_states, timestep, **_):
        self.timestep = timestep
        return (torch.zeros_like(hidden_states),)


def test_every_served_family_is_covered():
    assert sorted(CONDITIONING) == native_families()


@pytest.mark.parametrize("name", sorted(CONDITIONING))
def test_the_native_timestep_is_the_actors(name):
    family = get_family(name)
    transformer = RecordingTransformer()
    sigmas = torch.tensor([0.9173, 0.0313])
    cond = family.conditioning(*CONDITIONING[name]())
    family.predict_velocity(transformer, torch.randn(LATENTS[name]), sigmas, cond, 1.0)
    assert torch.equal(family.native.timestep(sigmas), transformer.timestep)


@pytest.mark.parametrize("name", ["flux", "qwen_image"])
def test_a_packed_familys_step_noise_is_its_initial_latents_draw(name):
    family = get_family(name)
    assert family.native.noise is packed_step_noise
    pipe = SimpleNamespace(vae_scale_factor=8, transformer=SimpleNamespace(config=SimpleNamespace(in_channels=64)))
    initial = family.initial_latents(pipe, [torch.Generator().manual_seed(s) for s in (1, 2)], 64)
    drawn = family.native.noise([torch.Generator().manual_seed(s) for s in (1, 2)], initial)
    assert torch.equal(drawn, initial)
    assert not torch.equal(unpacked_step_noise([torch.Generator().manual_seed(s) for s in (1, 2)], initial), initial)
