"""HTTP requests of the remote rewards (`http`, `vlm_judge`), with bounded retries.

Connection errors, timeouts, a connection dropped mid-request, 5xx answers and malformed
bodies (the caller's `parse` raising ValueError) are retried `retries` times with
exponential backoff (tenacity: `backoff_s`, doubled each time, at most `max_backoff_s`);
then, or at once for a 4xx answer (the server refusing the request), `RewardUnavailable`
names the reward, the URL and the last failure. Needs the `reward-http` extra (httpx, tenacity).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from omegaconf import MISSING

from omni.rewards.base import RewardOptions, RewardUnavailable

logger = logging.getLogger(__name__)


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


def check_remote_options(options: RemoteOptions, key: str) -> None:
    if not options.url.startswith(("http://", "https://")):
        raise ValueError(f"{key}.url={options.url}: expected http://host:port or https://...")
    if options.timeout_s <= 0 or options.retries < 0 or options.backoff_s < 0 or options.max_backoff_s < 0:
        raise ValueError(f"{key}: timeout_s must be positive and retries, backoff_s, max_backoff_s >= 0")


class TransientAnswer(Exception):
    """A 5xx or malformed answer: worth another try."""


class RefusedRequest(Exception):
    """A 4xx answer: the server will not serve this request; trying again will not help."""


def import_client():
    try:
        import httpx
        import tenacity
    except ImportError as error:
        raise ImportError(f"remote rewards need the reward-http extra ({error.name} is missing): pip install -e '.[reward-http]'") from None
    return httpx, tenacity


class RetryingClient:
    """An httpx client on `options.url` for reward `name`, whose options live under `key`."""

    def __init__(self, name: str, options: RemoteOptions, key: str, headers: Optional[Dict[str, str]] = None):
        httpx, _ = import_client()
        self.name, self.url, self.options, self.key = name, options.url.rstrip("/"), options, key
        self.client = httpx.Client(base_url=self.url, timeout=options.timeout_s, headers=headers)

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, route: str, parse: Callable[[Any], Any], **kwargs) -> Any:
        """`parse(answer JSON)` of a request, retried as the module docstring says."""
        httpx, tenacity = import_client()
        options = self.options
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(options.retries + 1),
            wait=tenacity.wait_exponential(multiplier=options.backoff_s, max=options.max_backoff_s),
            retry=tenacity.retry_if_exception_type((httpx.TransportError, TransientAnswer)),
            before_sleep=lambda state: logger.warning(
                "reward '%s': %s %s%s failed (%s); try %d of %d", self.name, method, self.url, route,
                self.describe(state.outcome.exception()), state.attempt_number + 1, options.retries + 1,
            ),
            reraise=True,
        )
        where = f"reward '{self.name}': {method} {self.url}{route}"
        try:
            return retrying(self.attempt, method, route, parse, **kwargs)
        except (httpx.TransportError, TransientAnswer) as error:
            raise RewardUnavailable(
                f"{where} failed {options.retries + 1} times ({self.key}.retries={options.retries}); last: {self.describe(error)}"
            ) from None
        except RefusedRequest as error:
            raise RewardUnavailable(f"{where}: the server refused the request: {error}") from None

    def attempt(self, method: str, route: str, parse: Callable[[Any], Any], **kwargs) -> Any:
        response = self.client.request(method, route, **kwargs)
        if response.status_code >= 500:
            raise TransientAnswer(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            raise RefusedRequest(f"HTTP {response.status_code}: {response.text[:500]}")
        try:
            return parse(response.json())
        except ValueError as error:  # includes a body that is not JSON
            raise TransientAnswer(f"malformed answer: {str(error)[:300]}") from None

    def describe(self, error: BaseException) -> str:
        httpx, _ = import_client()
        if isinstance(error, httpx.TimeoutException):
            return f"no answer within {self.options.timeout_s} s ({self.key}.timeout_s)"
        if isinstance(error, httpx.ConnectError):
            return f"cannot connect ({error})"
        if isinstance(error, httpx.TransportError):
            return f"the connection broke mid-request ({type(error).__name__}: {error})"
        return str(error)
