"""The driver's HTTP client of the rollout engine process (`omni.rollout.vllm_server`).

Every call but /shutdown is safe to repeat (a rollout is seeded, a weight sync names a
directory that stays until the sync is acknowledged), so a call whose connection fails or
breaks, or that a proxy answers 502/503/504, is retried (`omni.retrying`, with
`rollout.options.retries`, `backoff_s`, `max_backoff_s`); a read timeout is not (the engine
is still at it: a retry would queue the same work behind it). Any other answer that is not
200 is the engine's own error (an exception in the backend: 500 with its traceback; a bad
request: 4xx), raised at once as `EngineError` with the engine's message. Calls that still
fail raise `EngineUnreachable`, naming the route, the tries and the last failure.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Tuple

import torch

from omni import retrying
from omni.rollout.transport import unpack
from omni.rollout.vllm_options import VllmOptions

# What a proxy (or a server restarting behind one) answers; our server never does.
PROXY_FAILURES = (502, 503, 504)


class EngineError(RuntimeError):
    """The engine answered with an error (its message is the engine's)."""


class EngineUnreachable(ConnectionError):
    """The engine could not be reached, or the connection broke, on every try."""


def retry_policy(options: VllmOptions, timeout_s: float = None) -> retrying.RetryPolicy:
    return retrying.RetryPolicy(
        "rollout.options",
        options.request_timeout if timeout_s is None else timeout_s,
        options.retries,
        options.backoff_s,
        options.max_backoff_s,
        timeout_name="request_timeout",
        retry_read_timeouts=False,
    )


def _check(route: str, response) -> None:
    if response.status_code in PROXY_FAILURES:
        raise retrying.TransientAnswer(f"HTTP {response.status_code}: {response.text[:300]}")
    if response.status_code != 200:
        raise retrying.RefusedRequest(f"/{route}: HTTP {response.status_code}: {response.text}")


class EngineClient:
    """Calls of one engine at `url`."""

    def __init__(self, url: str, options: VllmOptions):
        self.url = url.rstrip("/")
        self.http = retrying.RetryingClient(self.url, retry_policy(options))

    def close(self) -> None:
        self.http.close()

    def post(
        self, route: str, body: bytes, retry: bool = True, timeout: float = None
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """POST a packed message to /route; the unpacked answer."""

        def read(response):
            _check(route, response)
            return unpack(response.content)

        extra = {} if timeout is None else {"timeout": timeout}
        headers = {"Content-Type": "application/octet-stream"}
        return self._call("POST", route, read, retry, content=body, headers=headers, **extra)

    def health(self, retry: bool = True, timeout: float = 30.0) -> Dict[str, Any]:
        def read(response):
            _check("health", response)
            return json.loads(response.content)

        return self._call("GET", "health", read, retry, timeout=timeout)

    def _call(self, method: str, route: str, read, retry: bool, **kwargs):
        try:
            return self.http.request(method, f"/{route}", read, retry=retry, **kwargs)
        except retrying.RetriesExhausted as error:
            raise EngineUnreachable(f"the rollout engine: {error}") from None
        except retrying.RefusedRequest as error:
            raise EngineError(str(error)) from None
