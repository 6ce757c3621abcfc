"""The OCR reward with the real PP-OCRv5 model on images rendered by PIL, its edit distance,
and the prompt checks that stop a run before any model loads."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from omni.data.prompts import Prompt
from omni.rewards import reward_options
from omni.rewards.ocr import OcrReward, levenshtein, target_text, text_similarity


def rendered(text: str) -> torch.Tensor:
    """Black text on white, 96 x 320, as a (3, H, W) image in [0, 1]."""
    image = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(image).text((16, 24), text, fill="black", font=ImageFont.load_default(size=40))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    reward = OcrReward("ocr", reward_options("ocr", {}))
    reward.setup()
    yield reward
    reward.teardown()


def test_edit_distance_and_similarity():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert text_similarity("Hello  World", "hello world") == 1.0
    assert text_similarity("Hello  World", "hello world", normalize=False) < 1.0
    assert text_similarity("", "open") == 0.0 and text_similarity("a much longer reading", "open") == 0.0
    assert text_similarity("opem", "open") == pytest.approx(0.75)


def test_target_text_from_quotes_or_metadata():
    assert target_text('a neon sign that says "Open Late" at night') == "Open Late"
    assert target_text("a poster reading \u201cSALE\u201d") == "SALE"
    assert target_text(Prompt("a shop sign", {"text": "BAKERY"})) == "BAKERY"
    assert target_text("a red cat") is None and target_text('an empty "" sign') is None


def test_rendered_target_beats_other_text_beats_blank(ocr):
    prompts = ['a sign that says "Hello World"'] * 3
    images = torch.stack([rendered("Hello World"), rendered("Yellow Wood"), torch.ones(3, 96, 320)])
    assert ocr.read(images[0]).replace(" ", "").lower() == "helloworld"
    right, other, blank = ocr.score(images, prompts).tolist()
    assert right == 1.0 and 0.0 < other < right and blank == 0.0 and other > blank


def test_prompts_without_target_text_fail_at_validation(tmp_path):
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "OK"\n\na red cat\n')
    with pytest.raises(
        ConfigError,
        match=f"data.train={prompts}: {prompts}, line 3: reward.components.ocr needs the target text.*'a red cat'",
    ):
        validate(compose_config(["reward=ocr", "data=ocr", f"data.train={prompts}"]))
    with pytest.raises(
        ConfigError, match="data.train=omni:colors_train: .*colors_train.txt, line 1: reward.components.ocr needs"
    ):
        validate(compose_config(["reward=ocr"]))
    validate(compose_config(["reward=ocr", "data=ocr"]))  # the shipped OCR prompts have their texts
