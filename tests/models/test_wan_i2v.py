"""What the Wan image-to-video family adds to the contract (tests/models/test_family_contract.py
holds it to the pipeline's clips and LoRA export): the first frame and its CLIP states both
steer the velocity, first frames of another size and checkpoints of another Wan I2V kind fail
before any model loads, naming what to change."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from omni.config.errors import ConfigError
from omni.data.prompts import Prompt
from omni.models.wan_i2v import FAMILY, TEXT_CONTEXT
from omni.validation import validate
from tests.conftest import compose_config


@pytest.fixture(scope="module")
def pipe(tiny_cache):
    return FAMILY.load_pipeline(FAMILY.tiny_path(tiny_cache, 0), torch.float32)


def first_frame(path, seed: int, size: int = 64):
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return Prompt("a cat walks", origin=f"frame {seed}", images=[path])


def velocity(pipe, prompts, change=None):
    cond = FAMILY.encode_prompts(pipe, prompts, 1.0, TEXT_CONTEXT, "cpu")
    cond = FAMILY.complete_conditioning(pipe, cond, 64, 5)
    if change:
        cond = change(cond)
    latents = FAMILY.initial_latents(pipe, [torch.Generator().manual_seed(0) for _ in prompts], 64, 5)
    with torch.no_grad():
        return FAMILY.predict_velocity(pipe.transformer, latents, torch.full((len(prompts),), 0.7), cond, 1.0)


def test_the_first_frame_and_its_clip_states_steer_the_velocity(pipe, tmp_path):
    a, b = first_frame(tmp_path / "a.png", 0), first_frame(tmp_path / "b.png", 1)
    base = velocity(pipe, [a])
    assert (base - velocity(pipe, [b])).abs().max() > 1e-4  # another first frame
    no_clip = velocity(pipe, [a], lambda c: type(c)(**{**vars(c), "image_embeds": torch.zeros_like(c.image_embeds)}))
    assert (base - no_clip).abs().max() > 1e-4  # the image's cross-attention is live
    no_frame = velocity(pipe, [a], lambda c: type(c)(**{**vars(c), "condition": torch.zeros_like(c.condition)}))
    assert (base - no_frame).abs().max() > 1e-4  # the first frame's latents are read
    # one VAE encoding per distinct first frame, the rows of a group sharing it
    cond = FAMILY.complete_conditioning(pipe, FAMILY.encode_prompts(pipe, [a, b, a], 1.0, TEXT_CONTEXT, "cpu"), 64, 5)
    assert torch.equal(cond.condition[0], cond.condition[2]) and not torch.equal(cond.condition[0], cond.condition[1])
    assert cond.condition.shape == (3, 4 + 16, 2, 8, 8) and torch.equal(
        cond.condition[:, :4, 0], torch.ones(3, 4, 8, 8)
    )


def test_first_frames_of_another_size_fail_before_any_model_loads(tmp_path, tiny_cache):
    frame = first_frame(tmp_path / "small.png", 0, size=32)
    data = tmp_path / "frames.jsonl"
    data.write_text(json.dumps({"prompt": "a cat walks", "image": str(frame.images[0])}) + "\n")
    overrides = [f"model.cache_dir={tiny_cache}", "model=wan_i2v_tiny", "reward=frame_brightness", "data=edits"]
    overrides += [f"data.train={data}", f"data.eval={data}"]
    with pytest.raises(ConfigError, match=r"small.png is 32x32 pixels but the clips are 64x64"):
        validate(compose_config(overrides, tmp_path))
    with pytest.raises(ConfigError, match=r"model.max_sequence_length=16.*set model.max_sequence_length=512"):
        validate(compose_config([*overrides[:3], "data=recolor", "model.max_sequence_length=16"], tmp_path))


@pytest.mark.parametrize(
    "index, named",
    [
        ({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.9}, "two experts"),
        ({"expand_timesteps": True}, "first frame written into the noise"),
        ({"image_encoder": [None, None]}, "no image_encoder"),
    ],
)
def test_other_wan_image_to_video_checkpoints_are_refused(index, named, tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanImageToVideoPipeline", **index}))
    with pytest.raises(ValueError, match=named):
        FAMILY.check_path(str(tmp_path))
