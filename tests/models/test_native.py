"""The facts a family states for `rollout.options.backend=native` (`omni.models.native`):
the timestep it gives vLLM-Omni's transformer is the one its actor gives its own, bit for
bit (a transformer that records its timestep stands in for both), and a packed family's
step noise is its initial latents' draw; FLUX.1 Kontext's source is the one vLLM-Omni's
loop conditioned on, read back from its arguments, and so are Qwen-Image-Edit-Plus's sources
and their grids."""

from types import SimpleNamespace

import pytest
import torch

from omni.models import get_family
from omni.models.flux import image_ids
from omni.models.flux_kontext import reference_ids
from omni.models.native import packed_step_noise, unpacked_step_noise
from omni.models.packing import pack
from omni.rollout.native_support import native_families

B, TOKENS, WIDTH = 2, 16, 8
CONDITIONING = {  # one batch of each family's conditioning fields
    "sd3": lambda: (torch.randn(B, 5, 4), torch.randn(B, 4)),
    "flux": lambda: (torch.randn(B, 5, 4), torch.randn(B, 4)),
    "flux_kontext": lambda: (torch.randn(B, 5, 4), torch.randn(B, 4), torch.randn(B, WIDTH // 4, 4, 6)),
    "qwen_image": lambda: (torch.randn(B, 5, 4), torch.ones(B, 5, dtype=torch.long)),
    "qwen_image_edit_plus": lambda: (
        torch.randn(B, 5, 4),
        torch.ones(B, 5, dtype=torch.long),
        torch.randn(B, 6, WIDTH),
        torch.tensor([[(2, 3)]] * B),
    ),
    "wan": lambda: (torch.randn(B, 5, 4), None),
}
LATENTS = {
    "sd3": (B, 4, 4, 4),
    "flux": (B, TOKENS, WIDTH),
    "flux_kontext": (B, TOKENS, WIDTH),
    "qwen_image": (B, TOKENS, WIDTH),
    "qwen_image_edit_plus": (B, TOKENS, WIDTH),
    "wan": (B, 4, 2, 4, 4),
}


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


@pytest.mark.parametrize("name", ["flux", "flux_kontext", "qwen_image", "qwen_image_edit_plus"])
def test_a_packed_familys_step_noise_is_its_initial_latents_draw(name):
    family = get_family(name)
    assert family.native.noise is packed_step_noise
    pipe = SimpleNamespace(vae_scale_factor=8, transformer=SimpleNamespace(config=SimpleNamespace(in_channels=64)))
    initial = family.initial_latents(pipe, [torch.Generator().manual_seed(s) for s in (1, 2)], 64)
    drawn = family.native.noise([torch.Generator().manual_seed(s) for s in (1, 2)], initial)
    assert torch.equal(drawn, initial)
    assert not torch.equal(unpacked_step_noise([torch.Generator().manual_seed(s) for s in (1, 2)], initial), initial)


def test_kontexts_source_is_the_reference_vllm_omni_conditioned_on():
    """vLLM-Omni's loop gets the source packed, beside the latents' ids and the reference's
    (first coordinate 1); a non-square source comes back with its own shape."""
    family = get_family("flux_kontext")
    embeds, pooled, source = CONDITIONING["flux_kontext"]()
    ids = torch.cat([image_ids(TOKENS, "cpu", torch.float32), reference_ids(2, 3, "cpu", torch.float32)])
    given = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "image_latents": pack(source), "latent_ids": ids}
    assert tuple(given) == family.native.cond_arguments
    cond = family.native.conditioning(family, given, 16)
    assert torch.equal(cond.source, source) and torch.equal(cond.embeds, embeds)
    transposed = torch.cat([image_ids(TOKENS, "cpu", torch.float32), reference_ids(3, 2, "cpu", torch.float32)])
    assert not torch.equal(family.native.conditioning(family, {**given, "latent_ids": transposed}, 16).source, source)


def test_edit_plus_sources_and_grids_are_what_vllm_omnis_loop_was_given():
    """Its loop gets the sources' packed tokens one after the other and `img_shapes`: the
    output's grid, then each source's; the text keeps its own length (vision tokens included)."""
    family = get_family("qwen_image_edit_plus")
    embeds, neg = torch.randn(1, 7, 4), torch.randn(1, 5, 4)
    sources = torch.randn(1, 2 * 3 + 4 * 4, WIDTH)
    given = {
        "prompt_embeds": embeds,
        "prompt_embeds_mask": torch.ones(1, 7, dtype=torch.long),
        "negative_prompt_embeds": neg,
        "negative_prompt_embeds_mask": torch.ones(1, 5, dtype=torch.long),
        "image_latents": sources,
        "img_shapes": [[(1, 4, 4), (1, 2, 3), (1, 4, 4)]],
    }
    assert tuple(given) == family.native.cond_arguments
    cond = family.native.conditioning(family, given, 16)
    assert cond.source_grids.tolist() == [[[2, 3], [4, 4]]] and torch.equal(cond.sources, sources)
    assert torch.equal(cond.embeds, embeds) and torch.equal(cond.neg_embeds, neg) and cond.mask.shape == (1, 7)
    plain = family.native.conditioning(
        family, {**given, "negative_prompt_embeds": None, "negative_prompt_embeds_mask": None}, 16
    )
    assert plain.neg_embeds is None
