"""What is Qwen-Image-Edit-Plus's own beyond the family contract (tests/models/test_family_contract.py,
which compares our sampler with `QwenImageEditPlusPipeline` prompt by prompt): the source
images' VAE tokens steer the velocity, more sources are more conditioning tokens, a batch that
mixes prompts with one and two sources gives each prompt its lone velocity, an edit prompt
without a source fails naming its origin before the transformer runs, and rollout=vllm is
refused for the family. Through the python API (`sample_rollout` on `Prompt`s with images)."""

import pytest
import torch
from PIL import Image

from omni.data.prompts import Prompt
from omni.models import get_family
from omni.models.qwen_image import FAMILY as QWEN_IMAGE
from omni.models.qwen_image_edit_plus import FAMILY, tiny_qwen_image_edit_plus_path
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout
from tests.models.qwen_edit_sizes import small_edit_sources  # noqa: F401 (autouse)

GUIDED = 4.0


@pytest.fixture(scope="module")
def pipe(tiny_cache):
    pipe = FAMILY.load_pipeline(tiny_qwen_image_edit_plus_path(tiny_cache, seed=0), torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three random 64 px pictures, and a 96x64 one (another aspect ratio: another grid)."""
    root = tmp_path_factory.mktemp("sources")
    generator = torch.Generator().manual_seed(5)
    paths = []
    for i, (height, width) in enumerate([(64, 64)] * 3 + [(64, 96)]):
        pixels = (torch.rand(height, width, 3, generator=generator) * 255).to(torch.uint8).numpy()
        paths.append(root / f"source-{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def edit(images, text="a red cat", origin="edits.jsonl, line 1"):
    return Prompt(text, origin=origin, images=images)


def velocity(pipe, prompts, guidance=GUIDED, cond=None):
    cond = cond or FAMILY.encode_prompts(pipe, prompts, guidance, 16, "cpu")
    latents = FAMILY.initial_latents(pipe, [torch.Generator().manual_seed(3) for _ in prompts], 64)
    return FAMILY.predict_velocity(pipe.transformer, latents, torch.full((len(prompts),), 0.7), cond, guidance)


def test_family_and_published_size():
    assert get_family("qwen_image_edit_plus") is FAMILY
    assert FAMILY.edit and FAMILY.max_source_images == 3 and FAMILY.native.extended and not FAMILY.vllm_served
    # the same transformer as Qwen-Image, over three sources' tokens more
    config = {"num_layers": 60}
    assert FAMILY.sequence_length(config, 1024, 512) > QWEN_IMAGE.sequence_length(config, 1024, 512) + 3 * 4096


def test_another_source_gives_another_velocity(pipe, sources):
    """Another source changes the velocity, and so does swapping only its VAE tokens (the
    text encoder's view of the picture kept; the tiny transformer spreads its attention over
    4096 tokens of two noise pictures, so that change is small, but a rerun is exact)."""
    first, second = (FAMILY.encode_prompts(pipe, [edit([s])], GUIDED, 16, "cpu") for s in sources[:2])
    base = velocity(pipe, [edit(sources[:1])], cond=first)
    assert torch.equal(base, velocity(pipe, [edit(sources[:1])], cond=first))
    assert (base - velocity(pipe, [edit(sources[1:2])], cond=second)).abs().max() > 1e-3
    first.sources = second.sources
    assert (base - velocity(pipe, [edit(sources[:1])], cond=first)).abs().max() > 1e-4


@pytest.mark.real_source_sizes
def test_two_sources_give_more_conditioning_tokens(pipe, sources):
    one, two = (FAMILY.encode_prompts(pipe, [edit(sources[:n])], GUIDED, 16, "cpu") for n in (1, 2))
    assert two.sources.shape[1] == 2 * one.sources.shape[1] == 2 * 64 * 64  # VAE tokens at 1024 px
    assert two.mask.sum() > one.mask.sum() and two.neg_mask.sum() > one.neg_mask.sum()  # vision tokens
    assert two.source_grids.tolist() == [[[64, 64], [64, 64]]]


def test_mixed_batch_gives_each_prompt_its_lone_velocity(pipe, sources):
    """Prompts with one source, two sources and a source of another aspect ratio, as one batch,
    then each alone: the transformer runs each grid apart, the text cut to its own batch."""
    prompts = [edit(sources[:1]), edit(sources[1:3], "a blue dog with a tree"), edit(sources[3:])]
    together = velocity(pipe, prompts)
    alone = torch.cat([velocity(pipe, [p]) for p in prompts])
    assert torch.allclose(together, alone, atol=1e-5)


def test_conditioning_cast_to_the_transformers_dtype_gives_the_same_velocity(pipe, sources):
    """A worker casts every conditioning tensor to the transformer's dtype, the source grids
    too (found by an online DPO update): the velocity must not change."""
    prompts = [edit(sources[:1])]
    cond = FAMILY.encode_prompts(pipe, prompts, GUIDED, 16, "cpu")
    cast = cond.apply(lambda t: t.to(torch.float32))
    assert cast.source_grids.dtype == torch.float32
    assert torch.equal(velocity(pipe, prompts, cond=cast), velocity(pipe, prompts, cond=cond))


def test_an_edit_without_a_source_fails_naming_its_origin(pipe, sources, monkeypatch):
    def no_transformer(*args, **kwargs):
        raise AssertionError("the transformer ran")

    monkeypatch.setattr(pipe.transformer, "forward", no_transformer)
    options = SamplingOptions(2, 64, GUIDED, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 1))
    prompts = [edit(sources[:1]), edit([], origin="edits.jsonl, line 7")]
    with pytest.raises(ValueError, match="edits.jsonl, line 7: an edit prompt needs at least one source image"):
        sample_rollout(FAMILY, pipe, prompts, [1, 2], options, 2, torch.device("cpu"), torch.float32)


def test_sampled_images_follow_the_source(pipe, sources):
    options = SamplingOptions(2, 64, GUIDED, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 1))

    def images(source):
        prompts = [edit([source])]
        return sample_rollout(FAMILY, pipe, prompts, [1], options, 1, torch.device("cpu"), torch.float32).images

    assert (images(sources[0]) - images(sources[1])).abs().max() > 1e-3


def test_the_template_system_part_is_the_pipelines_dropped_tokens(pipe):
    """The tiny tokenizer spells the edit template's system part in as many tokens as the
    pipeline drops, so only the instruction's (and pictures') hidden states are kept."""
    system = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(system)["input_ids"]) == pipe.prompt_template_encode_start_idx == 64


def test_more_sources_than_the_family_takes_fail_naming_the_origin(pipe, sources):
    with pytest.raises(ValueError, match="edits.jsonl, line 1: .* at most 3 source images"):
        FAMILY.encode_prompts(pipe, [edit(sources)], GUIDED, 16, "cpu")


def test_rollout_vllm_is_refused_naming_the_family():
    from omni.config.errors import ConfigError
    from omni.validation import validate
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match="model.family=qwen_image_edit_plus is not yet served") as info:
        validate(compose_config(["model=qwen_image_edit_plus_tiny", "rollout=vllm"]))
    assert "use rollout.options.backend=native (vLLM-Omni's own pipeline of it) or rollout=diffusers" in str(info.value)
