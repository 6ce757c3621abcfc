"""PickScore, CLIPScore and the aesthetic predictor on tiny random CLIP models loaded from
disk: each score against the same quantity computed another way (the model's own forward),
batching, the prompt's part, and paths that fail at validation before any model loads."""

import numpy as np
import pytest
import torch

from omni.rewards import REWARDS, WeightedReward, reward_options
from omni.rewards.protocol import to_uint8
from tests.rewards.tiny_clip import build_tiny_clip, save_aesthetic_head

IMAGES = torch.rand(5, 3, 48, 40, generator=torch.Generator().manual_seed(0))
PROMPTS = ["a red cat", "a blue dog on a mat", "a green tree", "a photo", "a yellow bird singing"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), seed=0)


def loaded(name, **options):
    reward = REWARDS.get(name)(name, reward_options(name, options))
    reward.setup()
    return reward


@pytest.fixture(scope="module")
def forward(clip_dir):
    """CLIPModel's own forward on the processor's inputs: logits, unit image embeddings, scale."""
    from transformers import AutoProcessor, CLIPModel

    processor, model = AutoProcessor.from_pretrained(clip_dir), CLIPModel.from_pretrained(clip_dir).eval()
    inputs = processor(images=[to_uint8(i) for i in IMAGES], text=PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal(), out.image_embeds, model.logit_scale.exp()


@pytest.fixture(scope="module")
def pickscore(clip_dir):
    return loaded("pickscore", path=str(clip_dir))


def test_pickscore_is_the_models_logit(pickscore, forward):
    scores = pickscore.score(IMAGES, PROMPTS)
    assert torch.allclose(scores, forward[0], atol=1e-5)
    assert not torch.allclose(pickscore.score(IMAGES, PROMPTS[::-1]), scores, atol=1e-3)  # the prompt matters


def test_clipscore_is_clamped_cosine(clip_dir, forward):
    logits, _, scale = forward
    reward = loaded("clipscore", path=str(clip_dir), processor_path=str(clip_dir))
    scores = reward.score(IMAGES, PROMPTS)
    assert torch.allclose(scores, (100 * logits / scale).clamp(min=0), atol=1e-4) and (scores >= 0).all()
    quantized = torch.from_numpy(np.stack([to_uint8(i) for i in IMAGES])).permute(0, 3, 1, 2).float() / 255
    assert torch.equal(reward.score(quantized, PROMPTS), scores)  # images reach the processor as 8-bit


def test_batches_give_the_scores_of_one_call(clip_dir, pickscore):
    batched = WeightedReward({"pickscore": {"path": str(clip_dir), "batch_size": 2}})
    batched.rewards["pickscore"] = pickscore  # the loaded model, scored through the chunking
    assert torch.allclose(batched(IMAGES, PROMPTS)["pickscore"], pickscore.score(IMAGES, PROMPTS), atol=1e-5)


def test_aesthetic_head_on_unit_image_embeddings(clip_dir, forward, tmp_path):
    head_path = save_aesthetic_head(tmp_path / "head.pth", embedding_size=16, seed=1)
    state = torch.load(head_path, weights_only=True)
    expected = forward[1]
    for index in (0, 2, 4, 6, 7):  # the released MLP: linear layers, no activations
        expected = expected @ state[f"layers.{index}.weight"].T + state[f"layers.{index}.bias"]
    reward = loaded("aesthetic", path=str(clip_dir), head_path=str(head_path))
    assert torch.allclose(reward.score(IMAGES, PROMPTS), expected.squeeze(-1), atol=1e-5)
    assert torch.equal(reward.score(IMAGES, PROMPTS), reward.score(IMAGES, ["another prompt"] * 5))
    constant = save_aesthetic_head(tmp_path / "constant.pth", embedding_size=16, constant=6.5)
    assert torch.equal(
        loaded("aesthetic", path=str(clip_dir), head_path=str(constant)).score(IMAGES, PROMPTS), torch.full((5,), 6.5)
    )


def test_head_of_another_size_is_named(clip_dir, tmp_path):
    head_path = save_aesthetic_head(tmp_path / "head768.pth", embedding_size=768)
    with pytest.raises(ValueError, match="head_path=.*head768.pth: not an aesthetic head for 16-d CLIP embeddings"):
        loaded("aesthetic", path=str(clip_dir), head_path=str(head_path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["reward=pickscore"],
            "reward.components.pickscore.path is mandatory and not set: pass reward.components.pickscore.path=",
        ),
        (
            ["reward=pickscore", "reward.components.pickscore.path=/nonexistent/pickscore"],
            "reward.components.pickscore.path=/nonexistent/pickscore: not a model directory",
        ),
        (
            [
                "reward=clipscore",
                "reward.components.clipscore.path={clip}",
                "reward.components.clipscore.processor_path=/nope",
            ],
            "reward.components.clipscore.processor_path=/nope: not a model directory",
        ),
        (
            [
                "reward=aesthetic",
                "reward.components.aesthetic.path={clip}",
                "reward.components.aesthetic.head_path=/nope.pth",
            ],
            "reward.components.aesthetic.head_path=/nope.pth: no such file",
        ),
        (
            ["reward=clipscore", "reward.components.clipscore.path={clip}", "reward.components.clipscore.dtype=fp8"],
            "reward.components.clipscore.dtype=fp8: expected one of",
        ),
    ],
)
def test_bad_paths_fail_at_validation(clip_dir, overrides, message):
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=message.replace("{clip}", str(clip_dir))):
        validate(compose_config([o.replace("{clip}", str(clip_dir)) for o in overrides]))


def test_dtype_option_reaches_the_model(clip_dir, pickscore):
    reward = loaded("pickscore", path=str(clip_dir), dtype="bfloat16")
    assert reward.model.dtype == torch.bfloat16
    fp32 = pickscore.score(IMAGES, PROMPTS)
    assert torch.allclose(reward.score(IMAGES, PROMPTS), fp32, atol=0.1 * float(fp32.abs().max()) + 0.05)
