"""The reward server and the `http` client against real servers on 127.0.0.1: the same
scores as in process, and each fault (5xx, malformed body, too slow, connection dropped,
nothing listening, a refused request) retried a bounded number of times with backoff, then
a clear error naming the reward and the URL."""

import asyncio
import time

import fastapi
import numpy as np
import pytest
import torch

from omni.data.prompts import Prompt
from omni.distributed import free_port
from omni.rewards import WeightedReward, reward_options
from omni.rewards.base import RewardUnavailable
from omni.rewards.http import HttpReward
from omni.rewards.protocol import parse_score_request, quantize, score_request
from omni.rewards.serve import build_app, reward_from_overrides
from omni.rewards.serve import main as serve_main
from tests.servers import dropping_server, uvicorn_server

IMAGES = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
PROMPTS = [Prompt(f"a red cat {i}", {"tag": "colors", "index": i}) for i in range(5)]


def client(url, **options):
    options = {"url": url, "retries": 2, "backoff_s": 0.05, "timeout_s": 5.0, **options}
    reward = HttpReward("http", reward_options("http", options))
    reward.setup()
    return reward


def fault_app(behaviour, seen):
    """An app whose /score misbehaves as `behaviour` says; `seen` gets each request's time."""
    app = fastapi.FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True, "reward": [behaviour]}

    @app.post("/score")
    async def score(request: fastapi.Request):
        seen.append(time.monotonic())
        body = await request.json()
        if behaviour == "flaky" and len(seen) <= 2 or behaviour == "500":
            return fastapi.Response("reward model crashed", status_code=500)
        if behaviour == "malformed":
            return fastapi.Response('{"scores": [1.0, ', media_type="application/json")
        if behaviour == "short":
            return {"scores": [1.0]}
        if behaviour == "slow":
            await asyncio.sleep(1.0)
        if behaviour == "refuse":
            return fastapi.Response("prompt 0 has no tag", status_code=422)
        if behaviour == "nan":  # as Python's json writes a NaN score (the protocol lets one through)
            return fastapi.Response('{"scores": [NaN, 1.0, 2.0, NaN, 3.0]}', media_type="application/json")
        return {"scores": [float(len(p)) for p in body["prompts"]]}

    return app


def test_request_carries_images_prompts_and_metadata():
    images, prompts = parse_score_request(score_request(IMAGES, PROMPTS))
    assert torch.equal(images, quantize(IMAGES)) and (quantize(IMAGES) - IMAGES).abs().max() <= 0.5 / 255 + 1e-7
    assert prompts == PROMPTS and [p.metadata for p in prompts] == [p.metadata for p in PROMPTS]
    with pytest.raises(ValueError, match="images\\[1\\] is not a base64 PNG"):
        parse_score_request(
            {"prompts": ["a", "b"], "images": [score_request(IMAGES[:1], ["a"])["images"][0], "bm90IGEgcG5n"]}
        )


def test_served_reward_scores_as_in_process():
    """The real server app over HTTP, batched by the client's weighted reward (3 + 2 images)."""
    served = WeightedReward({"brightness": {"weight": 2.0}, "jpeg_compressibility": {}})
    with uvicorn_server(build_app(served)) as url:
        remote = WeightedReward({"http": {"url": url, "batch_size": 3}})
        remote.setup()
        try:
            scores = remote(IMAGES, PROMPTS)["http"]
        finally:
            remote.teardown()
    assert torch.equal(scores, served(quantize(IMAGES), PROMPTS)["reward"])


def test_retries_recover_from_transient_failures():
    seen = []
    with uvicorn_server(fault_app("flaky", seen)) as url:
        scores = client(url).score(IMAGES[:2], PROMPTS[:2])
    assert scores.tolist() == [float(len(p)) for p in PROMPTS[:2]] and len(seen) == 3
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # exponential backoff


@pytest.mark.parametrize(
    "behaviour, last",
    [
        ("500", "HTTP 500: reward model crashed"),
        ("malformed", "malformed answer"),
        ("short", "1 scores for 2 images"),
        ("slow", "no answer within 0.3 s"),
    ],
)
def test_faults_are_retried_then_named(behaviour, last):
    seen = []
    with uvicorn_server(fault_app(behaviour, seen)) as url:
        with pytest.raises(RewardUnavailable) as error:
            client(url, timeout_s=0.3).score(IMAGES[:2], PROMPTS[:2])
    message = str(error.value)
    assert f"reward 'http': POST {url}/score failed 3 times" in message and last in message
    assert len(seen) == 3


def test_dropped_connection_is_retried_then_named():
    with dropping_server() as (url, accepted):
        with pytest.raises(RewardUnavailable, match="failed 3 times.*connection broke mid-request"):
            client(url).score(IMAGES[:2], PROMPTS[:2])
    assert len(accepted) == 3


def test_refused_request_is_not_retried():
    seen = []
    with uvicorn_server(fault_app("refuse", seen)) as url:
        with pytest.raises(RewardUnavailable, match="refused the request: HTTP 422: prompt 0 has no tag"):
            client(url).score(IMAGES[:2], PROMPTS[:2])
    assert len(seen) == 1


def test_nothing_listening_fails_at_setup():
    url = f"http://127.0.0.1:{free_port()}"
    reward = HttpReward("http", reward_options("http", {"url": url, "retries": 1, "backoff_s": 0.0}))
    with pytest.raises(RewardUnavailable, match=f"GET {url}/health failed 2 times.*cannot connect"):
        reward.setup()


def test_server_cli_names_a_bad_option_and_exits(capsys):
    with pytest.raises(SystemExit) as stopped:
        serve_main(["--port", "0", "reward=pickscore", "reward.components.pickscore.path=/nonexistent/ckpt"])
    assert stopped.value.code == 2
    assert "reward.components.pickscore.path=/nonexistent/ckpt: not a model directory" in capsys.readouterr().err


def test_server_composes_the_reward_group():
    reward = reward_from_overrides(["reward=multi", "reward.components.jpeg_compressibility.quality=50"])
    assert (
        set(reward.rewards) == {"brightness", "jpeg_compressibility"}
        and reward.rewards["jpeg_compressibility"].options.quality == 50
    )
    with pytest.raises(Exception, match="reward.components.jpeg_compressibility.qualty"):
        reward_from_overrides(["reward=jpeg_compressibility", "reward.components.jpeg_compressibility.qualty=5"])


def test_unreachable_server_stops_the_run_before_the_model_loads(tmp_path):
    from omni.trainer import run
    from tests.conftest import compose_config

    url, cache = f"http://127.0.0.1:{free_port()}", tmp_path / "model-cache"
    overrides = [
        "reward=http",
        f"reward.components.http.url={url}",
        "reward.components.http.retries=1",
        "reward.components.http.backoff_s=0",
    ]
    cfg = compose_config([*overrides, f"model.cache_dir={cache}"], output_dir=tmp_path / "run")
    with pytest.raises(
        RewardUnavailable, match=f"reward 'http': GET {url}/health failed 2 times.*cannot connect.*during set-up"
    ):
        run(cfg)
    assert not cache.exists() or not any(cache.iterdir())  # the tiny SD3 was never built


def test_geneval_prompts_need_their_metadata():
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    url = "reward.components.http.url=http://127.0.0.1:8000"
    with pytest.raises(
        ConfigError,
        match=r"data.train=omni:colors_train: .*colors_train.txt, line 1: reward.components.http needs metadata "
        r"\['tag', 'include'\]",
    ):
        validate(compose_config(["reward=geneval", url]))
    cfg = validate(compose_config(["reward=geneval", "data=geneval", url]))
    assert cfg.reward.components["http"].required_metadata == ["tag", "include"]


def test_served_ocr_gets_metadata_and_refuses_prompts_without_text():
    """Metadata crosses the wire (a target text only in the metadata is scored), and the
    server refuses, without retries, a prompt its reward cannot score."""
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(canvas).text((16, 24), "BAKERY", fill="black", font=ImageFont.load_default(size=40))
    image = torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1).float()[None] / 255
    served = WeightedReward({"ocr": {}})
    served.setup()
    with uvicorn_server(build_app(served)) as url:
        remote = client(url)
        assert remote.score(image, [Prompt("a shop sign", {"text": "BAKERY"})]).tolist() == [1.0]
        with pytest.raises(
            RewardUnavailable,
            match="refused the request: HTTP 400: .*request prompt 0.*'a shop sign'"
            ".*reward 'ocr' needs the target text",
        ):
            remote.score(image, [Prompt("a shop sign")])


@pytest.mark.slow
def test_server_failing_mid_run_stops_it_naming_reward_url_and_step(tiny_cache, tmp_path):
    """The held-out evaluation (one request) is scored, then the server fails every request:
    the run stops at training step 1, after the bounded retries, and says what it kept."""
    from omni.trainer import run
    from tests.conftest import compose_config

    seen, app = [], fastapi.FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True, "reward": ["brightness"]}

    @app.post("/score")
    def score(body: dict):
        seen.append(len(body["images"]))
        if len(seen) > 1:
            return fastapi.Response("out of memory", status_code=503)
        return {"scores": [0.5] * len(body["images"])}

    (tmp_path / "eval.txt").write_text("a red cube\n")
    with uvicorn_server(app) as url:
        overrides = [
            "reward=http",
            f"reward.components.http.url={url}",
            "reward.components.http.retries=1",
            "reward.components.http.backoff_s=0",
            f"data.eval={tmp_path / 'eval.txt'}",
            "trainer.steps=1",
            "trainer.batch_size=8",
            "algorithm.group_size=4",
            "eval.images_per_prompt=1",
            "trainer.progress_bar=false",
            f"model.cache_dir={tiny_cache}",
        ]
        with pytest.raises(RewardUnavailable) as error:
            run(compose_config(overrides, tmp_path / "run"))
    message = str(error.value)
    assert f"reward 'http': POST {url}/score failed 2 times" in message and "HTTP 503: out of memory" in message
    assert "during training step 1. Training stopped: no checkpoint was saved yet" in message
    assert seen == [1, 8, 8]  # the evaluation, then one training batch tried twice


def test_server_answering_nan_is_named_by_its_url():
    from omni.rewards import NonFiniteReward

    with uvicorn_server(fault_app("nan", [])) as url:
        reward = WeightedReward({"http": {"url": url, "retries": 0}})
        reward.setup()
        try:
            scores = reward(IMAGES, PROMPTS)
            with pytest.raises(
                NonFiniteReward, match=rf"during training step 3: 'http' \(served by {url}\) on 2 of 5 images"
            ):
                reward.finite(scores, "training step 3")
        finally:
            reward.teardown()


def test_docs_describe_the_protocol_and_a_bad_body_is_refused_naming_the_field():
    """The server's bodies are pydantic models: /openapi.json (what /docs shows) has them, and
    a body that does not fit is a 400 (refused, not retried) that names the field."""
    import httpx

    reward = WeightedReward({"brightness": {}})
    with uvicorn_server(build_app(reward)) as url:
        spec = httpx.get(f"{url}/openapi.json").json()
        assert httpx.get(f"{url}/docs").status_code == 200
        schemas = spec["components"]["schemas"]
        assert set(schemas["ScoreRequest"]["properties"]) == {"prompts", "images", "metadata", "sources", "targets"}
        assert schemas["ScoreResponse"]["properties"]["scores"]["type"] == "array"
        assert spec["paths"]["/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ScoreRequest"
        )
        assert set(schemas["Health"]["properties"]) == {"ok", "reward"}
        bad = httpx.post(f"{url}/score", json={"prompts": "a cat", "images": []})
        assert bad.status_code == 400 and "prompts" in bad.json()["detail"]
        assert (
            httpx.post(f"{url}/score", content=b"{not json", headers={"Content-Type": "application/json"}).status_code
            == 400
        )
        answer = httpx.post(f"{url}/score", json=score_request(IMAGES[:2], PROMPTS[:2]))  # the client's body, unchanged
        assert answer.status_code == 200 and len(answer.json()["scores"]) == 2


def test_served_edit_rewards_get_the_sources_and_targets_and_score_as_in_process():
    """Edits cross with their source and target images (not the client's local paths): the
    served edit rewards score them as in process."""
    from omni.data.prompt_sets import load_prompt_set
    from omni.rewards.edit_regions import references

    edits = load_prompt_set("omni:recolor_eval")[:4]
    images = torch.stack([references(e, (64, 64))[k % 2] for k, e in enumerate(edits)])  # source, target, ...
    body = score_request(images, edits)
    assert all("target" not in m for m in body["metadata"]) and len(body["sources"]) == len(body["targets"]) == 4
    served = WeightedReward({"edit_target": {}, "edit_consistency": {}})
    with uvicorn_server(build_app(served)) as url:
        remote = WeightedReward({"http": {"url": url, "batch_size": 3}})
        remote.setup()
        try:
            scores = remote(images, edits)["http"]
        finally:
            remote.teardown()
    assert torch.equal(scores, served(quantize(images), edits)["reward"])
    assert scores[1] > scores[0]  # the target beats the untouched source
