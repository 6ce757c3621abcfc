"""Edit data and model families must agree, before any model loads: source images given to a
text-to-image family, or more sources than an edit family takes, are named with the file and
line."""

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
