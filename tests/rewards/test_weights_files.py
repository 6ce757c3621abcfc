"""A learned reward's weights file cut short or damaged is named at validation (before any
model loads) with the reward, its option and the file, not by a library error at set-up."""

import pytest
import torch
from safetensors.torch import save_file

from omni.rewards.weights_files import weights_problem
from omni.validation import ConfigError, validate
from tests.conftest import compose_config
from tests.data.damage import truncate
from tests.rewards.tiny_clip import build_tiny_clip, save_aesthetic_head


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("clip"))


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _aesthetic(clip_dir, head, tmp_path):
    return [
        "reward=aesthetic",
        f"reward.components.aesthetic.path={clip_dir}",
        f"reward.components.aesthetic.head_path={head}",
    ]


@pytest.mark.parametrize(
    "suffix, damage", [(".pth", "truncate"), (".pth", "flip"), (".safetensors", "truncate"), (".safetensors", "header")]
)
def test_damaged_aesthetic_head_is_named_at_validation(clip_dir, tmp_path, suffix, damage):
    head = save_aesthetic_head(tmp_path / "head.pth", embedding_size=16)
    if suffix == ".safetensors":
        save_file(torch.load(head, weights_only=True), str(tmp_path / "head.safetensors"))
        head = tmp_path / "head.safetensors"
    validate(compose_config(_aesthetic(clip_dir, head, tmp_path), tmp_path))  # whole: accepted
    if damage == "truncate":
        truncate(head, 0.7)
    elif damage == "flip":
        _flip_middle_byte(head)
    else:
        head.write_bytes(head.read_bytes()[:8] + b"{not json" + head.read_bytes()[17:])
    with pytest.raises(
        ConfigError,
        match=rf"reward.components.aesthetic.head_path={head}: reward 'aesthetic' cannot use this weights file",
    ):
        validate(compose_config(_aesthetic(clip_dir, head, tmp_path), tmp_path))


def test_truncated_weights_in_a_clip_model_directory_are_named(clip_dir, tmp_path):
    import shutil

    damaged = tmp_path / "clip"
    shutil.copytree(clip_dir, damaged)
    weights = next(damaged.glob("*.safetensors"))
    truncate(weights, 0.9)
    with pytest.raises(
        ConfigError,
        match=rf"reward.components.pickscore.path={damaged}: reward 'pickscore' cannot use its weights file "
        rf"{weights}: .*truncated",
    ):
        validate(compose_config(["reward=pickscore", f"reward.components.pickscore.path={damaged}"], tmp_path))


def test_truncated_hps_checkpoint_is_named(tmp_path):
    checkpoint = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}}, checkpoint)
    assert weights_problem(checkpoint) is None
    truncate(checkpoint, 0.5)
    with pytest.raises(
        ConfigError, match=rf"reward.components.hpsv2.path={checkpoint}: reward 'hpsv2' cannot use this weights file"
    ):
        validate(compose_config(["reward=hpsv2", f"reward.components.hpsv2.path={checkpoint}"], tmp_path))
