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
