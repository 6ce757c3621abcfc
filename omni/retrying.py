"""HTTP calls with bounded retries (httpx + tenacity): the client side of our remote
services, the remote rewards (`omni.rewards.retrying`) and the rollout engine
(`omni.rollout.engine_client`).

`RetryingClient.request` makes one call at most `retries + 1` times. An attempt is worth
another try when the transport fails (no connection, a timeout, the connection dropped
mid-request: `httpx.TransportError`) or when the caller's `read(response)` raises
`TransientAnswer` (e.g. a 5xx); the wait before try k + 1 is `backoff_s * 2 ** (k - 1)`
seconds, at most `max_backoff_s`. `read` raising `RefusedRequest` (the server will not
serve this request: trying again will not help) ends the call at once, as does any other
exception. After the last try `RetriesExhausted` names the call, the number of tries and
the last failure. Only idempotent calls belong here with `retries > 0`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import httpx
import tenacity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries; `key` is where its options live, named in its errors."""

    key: str
    timeout_s: float
    retries: int
    backoff_s: float
    max_backoff_s: float
    # The option name of `timeout_s` under `key`.
    timeout_name: str = "timeout_s"
    # A read timeout means the server has the request and is still at it: retrying it
    # queues the same work again behind it. False for calls that may legitimately run long.
    retry_read_timeouts: bool = True

    def problem(self) -> Optional[str]:
        """What is wrong with these values, naming the key (None when nothing is)."""
        if not self.timeout_s > 0:
            return f"{self.key}.{self.timeout_name}={self.timeout_s} must be positive"
        for name in ("retries", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) >= 0:
                return f"{self.key}.{name}={getattr(self, name)} must be >= 0"
        return None


class TransientAnswer(Exception):
    """An answer worth another try (a 5xx, a malformed body)."""


class RefusedRequest(Exception):
    """The server will not serve this request; trying again will not help."""


class RetriesExhausted(Exception):
    """Every try failed; the message names the call, the tries and the last failure."""


class RetryingClient:
    """An httpx client on `url` whose calls retry as the module docstring says."""

    def __init__(self, url: str, policy: RetryPolicy, headers: Optional[Dict[str, str]] = None):
        self.url, self.policy = url.rstrip("/"), policy
        self.client = httpx.Client(base_url=self.url, timeout=policy.timeout_s, headers=headers)

    def close(self) -> None:
        self.client.close()

    def request(
        self, method: str, route: str, read: Callable[[httpx.Response], Any], retry: bool = True, **kwargs
    ) -> Any:
        """`read(response)` of `method route`, tried `policy.retries + 1` times (once
        without `retry`); `kwargs` go to httpx (json=, content=, headers=)."""
        policy = self.policy
        attempts = policy.retries + 1 if retry else 1
        where = f"{method} {self.url}{route}"
        timeout = kwargs.get("timeout", policy.timeout_s)
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_exponential(multiplier=policy.backoff_s, max=policy.max_backoff_s),
            retry=tenacity.retry_if_exception(self.retryable),
            before_sleep=lambda state: logger.warning(
                "%s failed (%s); try %d of %d",
                where,
                self.describe(state.outcome.exception(), timeout),
                state.attempt_number + 1,
                attempts,
            ),
            reraise=True,
        )
        try:
            return retrying(lambda: read(self.client.request(method, route, **kwargs)))
        except (httpx.TransportError, TransientAnswer) as error:
            tries = retrying.statistics.get("attempt_number", 1)
            why = f"{policy.key}.retries={policy.retries}" if retry else "not retried"
            raise RetriesExhausted(
                f"{where} failed {tries} time{'s' * (tries > 1)} ({why}); last: {self.describe(error, timeout)}"
            ) from None

    def retryable(self, error: BaseException) -> bool:
        if isinstance(error, httpx.ReadTimeout) and not self.policy.retry_read_timeouts:
            return False
        return isinstance(error, (httpx.TransportError, TransientAnswer))

    def describe(self, error: BaseException, timeout: float) -> str:
        if isinstance(error, httpx.TimeoutException):
            setting = f" ({self.policy.key}.{self.policy.timeout_name})" if timeout == self.policy.timeout_s else ""
            return f"no answer within {timeout} s{setting}"
        if isinstance(error, httpx.ConnectError):
            return f"cannot connect ({error})"
        if isinstance(error, httpx.TransportError):
            return f"the connection broke mid-request ({type(error).__name__}: {error})"
        return str(error)
