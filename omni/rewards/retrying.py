"""HTTP requests of the remote rewards (`http`, `vlm_judge`), with bounded retries.

Connection errors, timeouts, a connection dropped mid-request, 5xx answers and malformed
bodies (the caller's `parse` raising ValueError) are retried `retries` times with
exponential backoff (`omni.retrying`: `backoff_s`, doubled each time, at most
`max_backoff_s`); then, or at once for a 4xx answer (the server refusing the request),
`RewardUnavailable` names the reward, the URL and the last failure.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from omegaconf import MISSING

from omni import retrying
from omni.retrying import RetryPolicy
from omni.rewards.base import RewardOptions, RewardUnavailable


@dataclass
class RemoteOptions(RewardOptions):
    """Options of a reward behind an HTTP server."""

    # The server's base URL (see each reward for the routes it calls).
    url: str = MISSING
    # Seconds to wait for one answer (and for connecting).
    timeout_s: float = 120.0
    # Further tries after a connection error, a timeout, a 5xx or a malformed answer.
    retries: int = 3
    # Wait before the first retry in seconds; doubled for each next one, at most max_backoff_s.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


def served_by(options: RemoteOptions) -> str:
    """How a message names a remote reward's scores (`Reward.source`)."""
    return f" (served by {options.url.rstrip('/')})"


def check_remote_options(options: RemoteOptions, key: str) -> None:
    if not options.url.startswith(("http://", "https://")):
        raise ValueError(f"{key}.url={options.url}: expected http://host:port or https://...")
    problem = retry_policy(options, key).problem()
    if problem:
        raise ValueError(problem)


def retry_policy(options: RemoteOptions, key: str) -> RetryPolicy:
    return RetryPolicy(key, options.timeout_s, options.retries, options.backoff_s, options.max_backoff_s)


class RetryingClient:
    """An httpx client on `options.url` for reward `name`, whose options live under `key`."""

    def __init__(self, name: str, options: RemoteOptions, key: str, headers: Optional[Dict[str, str]] = None):
        self.name, self.url = name, options.url.rstrip("/")
        self.client = retrying.RetryingClient(self.url, retry_policy(options, key), headers)

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, route: str, parse: Callable[[Any], Any], **kwargs) -> Any:
        """`parse(answer JSON)` of a request, retried as the module docstring says."""
        try:
            return self.client.request(method, route, functools.partial(read_json, parse), **kwargs)
        except retrying.RetriesExhausted as error:
            raise RewardUnavailable(f"reward '{self.name}': {error}") from None
        except retrying.RefusedRequest as error:
            raise RewardUnavailable(
                f"reward '{self.name}': {method} {self.url}{route}: the server refused the request: {error}"
            ) from None


def read_json(parse: Callable[[Any], Any], response) -> Any:
    """`parse(response JSON)`; a 5xx or a malformed body is transient, a 4xx a refusal."""
    if response.status_code >= 500:
        raise retrying.TransientAnswer(f"HTTP {response.status_code}: {response.text[:300]}")
    if response.status_code >= 400:
        raise retrying.RefusedRequest(f"HTTP {response.status_code}: {response.text[:500]}")
    try:
        return parse(response.json())
    except ValueError as error:  # includes a body that is not JSON
        raise retrying.TransientAnswer(f"malformed answer: {str(error)[:300]}") from None
