"""What is FLUX.1 Kontext's own beyond the family contract (tests/models/test_family_contract.py):
the source image's reference tokens condition the velocity (another source, another velocity),
the velocity has the latents' token count though the transformer sees twice as many, a
non-square source is encoded and positioned as `FluxKontextPipeline.prepare_latents` does it,
an edit prompt without a source fails naming its origin before any model runs, validation
refuses the vLLM-Omni engine for it, and a short SDE rollout through the python API whose
log-probs the actor re-scores."""

import pytest
import torch
from PIL import Image

from omni.data.prompts import Prompt
from omni.models.flux_kontext import FAMILY, tiny_flux_kontext_path
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import rescore_log_probs, sample_rollout

SIZE, TEXT_LENGTH = 64, 16


@pytest.fixture(scope="module")
def pipe(tiny_cache):
    pipe = FAMILY.load_pipeline(tiny_flux_kontext_path(tiny_cache, seed=0), torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def source(path, seed: int, width: int = SIZE, height: int = SIZE) -> str:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(height, width, 3, generator=generator) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return str(path)


def edits(tmp_path, seeds=(1, 2), text="make the sky red"):
    return [
        Prompt(text, origin=f"edits.jsonl, line {i + 1}", images=[source(tmp_path / f"src-{s}.png", s)])
        for i, s in enumerate(seeds)
    ]


def velocity(pipe, prompts, latents=None):
    cond = FAMILY.encode_prompts(pipe, prompts, 2.5, TEXT_LENGTH, "cpu")
    if latents is None:
        latents = FAMILY.initial_latents(pipe, [torch.Generator().manual_seed(3)] * len(prompts), SIZE)
    with torch.no_grad():
        return FAMILY.predict_velocity(pipe.transformer, latents, torch.full((len(prompts),), 0.7), cond, 2.5)


def test_the_source_conditions_the_velocity_at_the_latents_tokens(pipe, tmp_path):
    """Same instruction and noise, two sources: two velocities, each of the latents' shape,
    while the transformer's input holds the reference tokens too."""
    prompts = edits(tmp_path)
    latents = FAMILY.initial_latents(pipe, [torch.Generator().manual_seed(3)] * 2, SIZE)
    v = velocity(pipe, prompts, latents)
    assert v.shape == latents.shape == (2, (SIZE // 16) ** 2, 64)
    assert (v[0] - v[1]).abs().max() > 1e-3
    cond = FAMILY.encode_prompts(pipe, prompts, 2.5, TEXT_LENGTH, "cpu")
    tokens, ids = FAMILY.image_tokens(latents, cond)
    assert tokens.shape[1] == ids.shape[0] == 2 * latents.shape[1]
    assert (ids[: latents.shape[1], 0] == 0).all() and (ids[latents.shape[1] :, 0] == 1).all()


def test_a_non_square_source_is_the_pipelines_reference(pipe, tmp_path):
    """A 70 x 50 source is used at 64 x 48 (rounded down to multiples of 16, no auto-resize):
    its latents and positions are those of FluxKontextPipeline's own preprocessing and
    `prepare_latents`."""
    image = Image.open(source(tmp_path / "wide.png", 5, width=70, height=50)).convert("RGB")
    ours = FAMILY.encode_source(pipe, image, "cpu")
    assert ours.shape == (1, 16, 48 // 8, 64 // 8)
    pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, 48, 64), 48, 64)
    noise = torch.zeros(1, (SIZE // 16) ** 2, 64)
    _, reference, _, their_ids = pipe.prepare_latents(
        pixels, 1, 16, SIZE, SIZE, torch.float32, "cpu", [torch.Generator()], noise
    )
    cond = FAMILY.conditioning(torch.zeros(1, TEXT_LENGTH, 64), torch.zeros(1, 32), ours)
    tokens, ids = FAMILY.image_tokens(noise, cond)
    assert torch.allclose(tokens[:, noise.shape[1] :], reference, atol=1e-6)
    assert torch.equal(ids[noise.shape[1] :], their_ids)


def test_an_edit_prompt_without_a_source_is_named_before_any_model_runs(pipe, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model ran before the sources were read")

    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        monkeypatch.setattr(module, "forward", no_model)
    prompts = edits(tmp_path) + [Prompt("make it blue", origin="edits.jsonl, line 9")]
    options = SamplingOptions(2, SIZE, 2.5, noise_level=0.7, max_sequence_length=TEXT_LENGTH, sde_steps=(0, 0))
    with pytest.raises(ValueError, match="edits.jsonl, line 9: an edit prompt needs at least one source image"):
        sample_rollout(FAMILY, pipe, prompts, [1, 2, 3], options, 4, torch.device("cpu"), torch.float32)


def test_sources_of_different_sizes_in_one_batch_are_named(pipe, tmp_path):
    prompts = [
        Prompt("a", origin="edits.jsonl, line 1", images=[source(tmp_path / "a.png", 1)]),
        Prompt("b", origin="edits.jsonl, line 2", images=[source(tmp_path / "b.png", 2, width=32)]),
    ]
    with pytest.raises(ValueError, match="one size only.*line 1.*line 2"):
        FAMILY.encode_prompts(pipe, prompts, 2.5, TEXT_LENGTH, "cpu")


def test_validation_refuses_the_vllm_engine_naming_the_family(tmp_path):
    from omni.config.errors import ConfigError
    from omni.validation import validate
    from tests.conftest import compose_config

    with pytest.raises(
        ConfigError, match="model.family=flux_kontext is not yet served by the vLLM-Omni engine"
    ) as info:
        validate(compose_config(["model=flux_kontext_tiny", "rollout=vllm", "data=recolor"], tmp_path))
    assert "use rollout.options.backend=native (vLLM-Omni's own pipeline of it) or rollout=diffusers" in str(info.value)


def test_an_sde_rollout_of_edits_is_rescored_by_the_actor(pipe, tmp_path):
    """End to end through the python API: a GRPO group of edits (two seeds per source) with SDE
    steps; the images differ by seed, and the actor's re-scoring gives back the rollout's
    log-probs (the stored conditioning carries the reference latents)."""
    prompts = [p for p in edits(tmp_path) for _ in range(2)]
    options = SamplingOptions(3, SIZE, 2.5, noise_level=0.7, max_sequence_length=TEXT_LENGTH, sde_steps=(0, 2))
    batch = sample_rollout(FAMILY, pipe, prompts, [1, 2, 1, 2], options, 2, torch.device("cpu"), torch.float32)
    assert batch.images.shape == (4, 3, SIZE, SIZE)
    assert batch.cond.source.shape == (4, 16, SIZE // 8, SIZE // 8)
    assert (batch.images[0] - batch.images[1]).abs().max() > 1e-3
    assert batch.log_probs[:, :2].isfinite().all() and (batch.log_probs[:, 2] == 0).all()
    rescored = rescore_log_probs(FAMILY, pipe.transformer, batch, torch.float32)
    assert torch.allclose(rescored, batch.log_probs, atol=1e-3)
