"""HPS v2 on a tiny random open_clip model built offline from a model config file and saved
as the released checkpoints are: the score is the cosine of the model's own normalised
embeddings on HPS's preprocessing, the checkpoint's weights are the ones scoring, and bad
paths fail at validation. Where open_clip does not import (no torchvision for this torch),
the reward says how to install it or serve it elsewhere."""

import json

import pytest
import torch
from PIL import Image

from omni.rewards import REWARDS, reward_options
from omni.rewards.hpsv2 import import_open_clip
from omni.rewards.protocol import to_uint8

IMAGES = torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(0))
PROMPTS = ["a red cat", "a blue dog on a mat", "a green tree"]
# A 2-layer ViT and text tower; the vocabulary is open_clip's own tokenizer's.
TINY = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}  # fmt: skip


def open_clip_or_skip():
    try:
        return import_open_clip()
    except ImportError as error:
        pytest.skip(str(error))


def loaded(path, architecture):
    reward = REWARDS.get("hpsv2")(
        "hpsv2", reward_options("hpsv2", {"path": str(path), "architecture": str(architecture)})
    )
    reward.setup()
    return reward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config file, checkpoint, the model): saved as HPS releases it, under 'state_dict' with DDP's prefix."""
    open_clip = open_clip_or_skip()
    directory = tmp_path_factory.mktemp("tiny-hps")
    config = directory / "tiny-hps-vit.json"
    config.write_text(json.dumps(TINY))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps-vit", pretrained=None).eval()
    torch.save(
        {"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 1}, directory / "hps.pt"
    )
    return config, directory / "hps.pt", model


def test_score_is_the_cosine_of_the_models_own_embeddings(tiny):
    open_clip = import_open_clip()
    config, checkpoint, model = tiny
    _, _, preprocess = open_clip.create_model_and_transforms("tiny-hps-vit", pretrained=None)
    pixels = torch.stack([preprocess(Image.fromarray(to_uint8(image))) for image in IMAGES])
    with torch.no_grad():
        image_features, text_features, _ = model(pixels, open_clip.get_tokenizer("tiny-hps-vit")(PROMPTS))
    expected = torch.diagonal(image_features @ text_features.T)
    reward = loaded(checkpoint, config)
    scores = reward.score(IMAGES, PROMPTS)
    assert torch.allclose(scores, expected, atol=1e-5) and scores.abs().max() <= 1
    assert not torch.allclose(reward.score(IMAGES, PROMPTS[::-1]), scores, atol=1e-4)  # the prompt matters


def test_the_checkpoint_weights_are_the_ones_scoring(tiny, tmp_path):
    open_clip = import_open_clip()
    config, checkpoint, _ = tiny
    torch.manual_seed(1)
    other = open_clip.create_model("tiny-hps-vit", pretrained=None)
    torch.save(other.state_dict(), tmp_path / "bare.pt")  # a bare state dict loads too
    assert not torch.allclose(
        loaded(tmp_path / "bare.pt", config).score(IMAGES, PROMPTS),
        loaded(checkpoint, config).score(IMAGES, PROMPTS),
        atol=1e-4,
    )
    wider = tmp_path / "wider-vit.json"
    wider.write_text(json.dumps({**TINY, "embed_dim": 24}))
    with pytest.raises(ValueError, match=f"path={checkpoint}: not an HPS checkpoint of wider-vit"):
        loaded(checkpoint, wider)


def test_bad_paths_fail_at_validation(tmp_path):
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match="reward.components.hpsv2.path=.*nope.pt: no such file"):
        validate(compose_config(["reward=hpsv2", f"reward.components.hpsv2.path={tmp_path}/nope.pt"], tmp_path))
    (tmp_path / "hps.pt").write_bytes(b"")
    with pytest.raises(
        ConfigError, match="reward.components.hpsv2.architecture=.*missing.json: no such open_clip model config"
    ):
        validate(
            compose_config(
                [
                    "reward=hpsv2",
                    f"reward.components.hpsv2.path={tmp_path}/hps.pt",
                    f"reward.components.hpsv2.architecture={tmp_path}/missing.json",
                ],
                tmp_path,
            )
        )


def test_without_open_clip_the_error_says_how_to_get_it(tmp_path):
    try:
        import_open_clip()
        pytest.skip("open_clip imports here")
    except ImportError:
        pass
    (tmp_path / "hps.pt").write_bytes(b"")
    reward = REWARDS.get("hpsv2")("hpsv2", reward_options("hpsv2", {"path": str(tmp_path / "hps.pt")}))
    with pytest.raises(ImportError, match=r"reward 'hpsv2' needs open_clip.*\.\[hpsv2\].*reward=http"):
        reward.setup()
