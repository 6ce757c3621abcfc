"""Edit data and model families must agree, before any model loads: source images given to a
text-to-image family, or more sources than an edit family takes, are named with the file and
line."""

from pathlib import Path

import pytest

from omni.validation import ConfigError, validate
from tests.conftest import compose_config


def test_edit_data_for_a_text_to_image_family_is_refused_with_its_line():
    with pytest.raises(
        ConfigError, match=r"recolor_train.jsonl, line 1: the prompt has source images but model.family=sd3"
    ):
        validate(compose_config(["data=recolor", "reward=edit"]))


def test_an_edit_reward_on_text_prompts_names_what_the_prompt_lacks():
    with pytest.raises(ConfigError, match=r"reward.components.edit_target needs a source image"):
        validate(compose_config(["reward=edit"]))


def test_text_prompts_for_an_edit_family_are_refused_with_their_line():
    with pytest.raises(ConfigError, match=r"colors_train.txt, line 1: model.family=flux_kontext edits images"):
        validate(compose_config(["model=flux_kontext_tiny"]))


def test_more_sources_than_the_family_takes_are_refused(tmp_path):
    rows = tmp_path / "edits.jsonl"
    source = Path(__file__).resolve().parents[2] / "omni/assets/recolor/recolor_train-000-source.png"
    rows.write_text(f'{{"prompt": "make it red", "images": ["{source}", "{source}"]}}\n')
    with pytest.raises(ConfigError, match=r"edits.jsonl, line 1: model.family=flux_kontext .* 1 to 1 source .* has 2"):
        validate(compose_config(["model=flux_kontext_tiny", f"data.train={rows}", "reward=edit_consistency"]))


def test_kontext_sources_of_two_sizes_are_refused_naming_both(tmp_path):
    """A batch stacks FLUX.1 Kontext's reference tokens: a set whose sources differ in size
    would fail mid-run; Qwen-Image-Edit-Plus sizes every source to one area and takes it."""
    from PIL import Image

    rows = []
    for i, size in enumerate(((64, 64), (64, 64), (96, 64))):
        Image.new("RGB", size).save(tmp_path / f"s{i}.png")
        rows.append(f'{{"prompt": "make it red", "image": "s{i}.png"}}\n')
    edits = tmp_path / "edits.jsonl"
    edits.write_text("".join(rows))
    overrides = [f"data.train={edits}", f"data.eval={edits}", "reward=edit_consistency"]
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=flux_kontext_tiny", *overrides]))
    message = str(info.value)
    assert f"data.train={edits}: model.family=flux_kontext batches sources of one size" in message
    assert "line 1 has a source of 64x64 pixels" in message and "line 3 one of 96x64" in message
    validate(compose_config(["model=qwen_image_edit_plus_tiny", *overrides]))
