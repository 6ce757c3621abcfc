"""The driver's client of the engine process against real servers on 127.0.0.1: a failure of
the transport or a proxy is retried a bounded number of times with backoff, then named with
the route and the tries; the engine's own error (500 with its traceback, a 4xx) and /shutdown
are never repeated. (The retried call's identical result with the real engine:
tests/rollout/test_vllm_engine.py.)"""

import asyncio
import time

import fastapi
import pytest

from omni.distributed import free_port
from omni.rollout.engine_client import EngineClient, EngineError, EngineUnreachable
from omni.rollout.transport import pack
from omni.rollout.vllm_options import VllmOptions
from tests.servers import dropping_server, uvicorn_server

OPTIONS = VllmOptions(retries=2, backoff_s=0.05, max_backoff_s=1.0, request_timeout=5.0)


def fault_app(status: int, seen: list):
    """/generate answers `status` (with a message) for its first two calls, then a blob."""
    app = fastapi.FastAPI()

    @app.post("/generate")
    async def generate(request: fastapi.Request):
        seen.append(time.monotonic())
        body = await request.body()
        if len(seen) <= 2:
            return fastapi.Response(f"Traceback: ValueError: step {len(seen)} failed", status_code=status)
        return fastapi.Response(body, media_type="application/octet-stream")

    return app


def test_proxy_failures_are_retried_with_backoff():
    seen = []
    with uvicorn_server(fault_app(503, seen)) as url:
        _, meta = EngineClient(url, OPTIONS).post("generate", pack(meta={"seeds": [1, 2]}))
    assert meta == {"seeds": [1, 2]} and len(seen) == 3
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # exponential backoff


@pytest.mark.parametrize("status", [500, 422])
def test_the_engines_own_error_is_not_retried(status):
    seen = []
    with uvicorn_server(fault_app(status, seen)) as url:
        with pytest.raises(EngineError, match=f"/generate: HTTP {status}: Traceback: ValueError: step 1 failed"):
            EngineClient(url, OPTIONS).post("generate", pack())
    assert len(seen) == 1


def test_dropped_connections_are_retried_then_named():
    with dropping_server() as (url, accepted):
        with pytest.raises(EngineUnreachable) as error:
            EngineClient(url, OPTIONS).post("update_weights", pack(meta={"path": "/x"}))
        assert len(accepted) == 3
        message = str(error.value)
        assert f"POST {url}/update_weights failed 3 times (rollout.options.retries=2)" in message
        assert "connection broke mid-request" in message
        with pytest.raises(EngineUnreachable, match="/shutdown failed 1 time \\(not retried\\)"):
            EngineClient(url, OPTIONS).post("shutdown", pack(), retry=False)
        assert len(accepted) == 4


def test_nothing_listening_is_named_and_is_an_os_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(OSError, match=f"GET {url}/health failed 2 times.*cannot connect"):
        EngineClient(url, VllmOptions(retries=1, backoff_s=0.0)).health()


def test_a_slow_engine_is_not_asked_twice():
    """A read timeout: the engine has the request and is still at it."""
    seen = []
    app = fastapi.FastAPI()

    @app.post("/generate")
    async def generate():
        seen.append(time.monotonic())
        await asyncio.sleep(1.0)
        return fastapi.Response(pack(), media_type="application/octet-stream")

    with uvicorn_server(app) as url:
        with pytest.raises(
            EngineUnreachable, match="failed 1 time .*no answer within 0.3 s \\(rollout.options.request_timeout\\)"
        ):
            EngineClient(url, VllmOptions(retries=2, backoff_s=0.0, request_timeout=0.3)).post("generate", pack())
    assert len(seen) == 1
