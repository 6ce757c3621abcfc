"""rollout=vllm attached to a running engine (rollout.options.url): validation asks its
/health, within a short timeout, so a URL that answers nothing is named before any model loads."""

import socket
import time

import pytest

from omni.distributed import free_port
from omni.rollout.vllm_engine import ENGINE_PROBE_TIMEOUT_S
from omni.validation import ConfigError, validate
from tests.conftest import compose_config
from tests.servers import dropping_server, uvicorn_server


def attached(url, tiny_cache, tmp_path):
    return compose_config(["rollout=vllm", f"rollout.options.url={url}", f"model.cache_dir={tiny_cache}"], tmp_path)


def refused_in_time(url, tiny_cache, tmp_path):
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        validate(attached(url, tiny_cache, tmp_path))
    assert (
        time.monotonic() - start < ENGINE_PROBE_TIMEOUT_S + 30
    )  # not request_timeout's hour (slack for a loaded runner)
    assert str(info.value).startswith(f"rollout.options.url={url}: no rollout engine answered GET /health")
    assert "(not retried)" in str(info.value)
    return str(info.value)


def test_url_with_nothing_listening_is_named(tiny_cache, tmp_path):
    assert "Connection refused" in refused_in_time(f"http://127.0.0.1:{free_port()}", tiny_cache, tmp_path)


def test_url_that_never_answers_is_named_after_the_probe_timeout(tiny_cache, tmp_path):
    """A listener whose backlog takes the connection but no one ever answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        message = refused_in_time(f"http://127.0.0.1:{silent.getsockname()[1]}", tiny_cache, tmp_path)
    assert f"no answer within {ENGINE_PROBE_TIMEOUT_S}" in message


def test_url_that_drops_the_connection_is_named(tiny_cache, tmp_path):
    with dropping_server() as (url, accepted):
        refused_in_time(url, tiny_cache, tmp_path)
    assert len(accepted) == 1  # one try: the probe does not retry


def test_url_of_an_answering_engine_validates(tiny_cache, tmp_path, monkeypatch):
    """Attaching needs no engine environment on this machine, only an engine that answers."""
    from fastapi import FastAPI

    monkeypatch.delenv("OMNI_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True, "has_base": True, "model": "tiny", "backend": "local"}

    with uvicorn_server(app) as url:
        assert validate(attached(url, tiny_cache, tmp_path)).rollout.options.url == url
