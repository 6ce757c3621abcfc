"""The VLM judge against a small OpenAI-compatible chat server on 127.0.0.1 whose "model"
rates an image by its brightness: the image and question reach it, its answers are parsed
and scaled, and an answer without a score is counted, logged and left non-finite."""

import base64
import io
import logging
import math

import fastapi
import numpy as np
import pytest
import torch
from PIL import Image

from omni.rewards import reward_options
from omni.rewards.base import RewardUnavailable
from omni.rewards.protocol import quantize
from omni.rewards.vlm_judge import VlmJudge
from tests.servers import uvicorn_server

IMAGES = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.2, 0.5, 0.8, 1.0]).view(
    4, 1, 1, 1
)
PROMPTS = ["a red cat", "a dark room", "an unsure sky", "a lamp"]


def chat_app(seen):
    """/v1/models and /v1/chat/completions of a 'brightness-judge' model."""
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "brightness-judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        seen.append(body)
        if body["model"] != "brightness-judge":
            raise fastapi.HTTPException(404, f"model {body['model']} not found")
        image_part, text_part = body["messages"][0]["content"]
        png = base64.b64decode(image_part["image_url"]["url"].split(",", 1)[1])
        brightness = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).mean() / 255
        answer = "I cannot tell." if "unsure" in text_part["text"] else f"Score: {brightness * 10:.4f}"
        return {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}],
        }

    return app


def judge(url, **options):
    options = {
        "url": f"{url}/v1",
        "model": "brightness-judge",
        "retries": 1,
        "backoff_s": 0.01,
        "concurrency": 2,
        **options,
    }
    reward = VlmJudge("vlm_judge", reward_options("vlm_judge", options))
    reward.setup()
    return reward


def test_scores_parsed_scaled_and_unparseable_counted(caplog):
    seen = []
    with uvicorn_server(chat_app(seen)) as url:
        reward = judge(url)
        with caplog.at_level(logging.WARNING, logger="omni.rewards.vlm_judge"):
            scores = reward.score(IMAGES, PROMPTS)
    expected = quantize(IMAGES).mean(dim=(1, 2, 3))
    assert torch.allclose(scores[[0, 1, 3]], expected[[0, 1, 3]], atol=1e-4) and math.isnan(scores[2])
    assert reward.unparseable == 1 and "1 of 4 answers held no score" in caplog.text and "I cannot tell." in caplog.text
    questions = sorted(body["messages"][0]["content"][1]["text"] for body in seen)
    assert len(seen) == 4 and all(any(f'"{p}"' in q for q in questions) for p in PROMPTS)


def test_unserved_model_fails_at_setup():
    with uvicorn_server(chat_app([])) as url:
        with pytest.raises(
            ValueError, match=r"reward.components.vlm_judge.model=qwen: .*/v1 serves \['brightness-judge'\]"
        ):
            judge(url, model="qwen")


def test_bad_chat_answers_are_retried_then_named():
    app, calls = fastapi.FastAPI(), []

    @app.get("/v1/models")
    def models():
        return {"data": [{"id": "brightness-judge"}]}

    @app.post("/v1/chat/completions")
    def chat():
        calls.append(1)
        return {"choices": []}

    with uvicorn_server(app) as url:
        with pytest.raises(
            RewardUnavailable, match="POST .*/v1/chat/completions failed 2 times.*not a chat completion"
        ):
            judge(url).score(IMAGES[:1], PROMPTS[:1])
    assert len(calls) == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"question": "Rate {image}"}, "question: only {prompt}"),
        ({"score_pattern": r"\d+"}, "score_pattern=.*: needs a group"),
        ({"score_pattern": "("}, "score_pattern=\\(:"),
        (
            {"api_key_env": "OMNI_TEST_UNSET_KEY"},
            "api_key_env=OMNI_TEST_UNSET_KEY: that environment variable is not set",
        ),
    ],
)
def test_bad_options_are_named(options, message):
    values = reward_options("vlm_judge", {"url": "http://127.0.0.1:1/v1", "model": "m", **options})
    with pytest.raises(ValueError, match=f"reward.components.vlm_judge.{message}"):
        VlmJudge.check_options(values, "reward.components.vlm_judge")


def test_an_edit_is_judged_with_its_source_before_the_result():
    from omni.data.prompt_sets import load_prompt_set

    edit = load_prompt_set("omni:recolor_eval")[0]
    seen = []
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "brightness-judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        seen.append(body)
        return {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}}],
        }

    with uvicorn_server(app) as url:
        assert judge(url).score(IMAGES[:1], [edit]).tolist() == [pytest.approx(0.7)]
    source_part, result_part, text_part = seen[0]["messages"][0]["content"]
    with open(edit.images[0], "rb") as stream:
        assert source_part["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(stream.read()).decode()
    assert result_part["image_url"]["url"].startswith("data:image/png;base64,")
    assert f'result of the edit "{edit}"' in text_part["text"]
