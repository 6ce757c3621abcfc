"""A reward scored by a server elsewhere (`reward=http`): GenEval in its own environment, a
big judge on its own GPUs, or any reward of ours behind `python -m omni.rewards.serve`.

Each `score` call is one POST /score carrying the batch (PNG images, prompts and their
metadata; see `omni.rewards.protocol` and docs/reward_server.md). Connection errors,
timeouts, a connection dropped mid-request, 5xx answers and malformed bodies are retried
`retries` times with exponential backoff (tenacity); when the tries are spent, or the
server refuses the request (4xx), `RewardUnavailable` names the reward, the URL and the
last failure (the trainer adds the training step). A failed request never becomes a score.
`setup` asks /health first, so a server that is not there stops the run before any
diffusion model loads. Needs the `reward-http` extra (httpx, tenacity).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import MISSING

from omni.rewards.base import Reward, RewardOptions, RewardUnavailable
from omni.rewards.protocol import parse_scores, score_request

logger = logging.getLogger(__name__)


@dataclass
class HttpOptions(RewardOptions):
    # The reward server's base URL, e.g. http://reward-host:8000 (routes /health and /score).
    url: str = MISSING
    # Seconds to wait for one answer (and for connecting).
    timeout_s: float = 120.0
    # Further tries after a connection error, a timeout, a 5xx or a malformed answer.
    retries: int = 3
    # Wait before the first retry in seconds; doubled for each next one, at most max_backoff_s.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


class TransientAnswer(Exception):
    """A 5xx or malformed answer: worth another try."""


class RefusedRequest(Exception):
    """A 4xx answer: the server will not score this request; trying again will not help."""


def import_client():
    try:
        import httpx
        import tenacity
    except ImportError as error:
        raise ImportError(f"reward=http needs the reward-http extra ({error.name} is missing): pip install -e '.[reward-http]'") from None
    return httpx, tenacity


class HttpReward(Reward):
    Options = HttpOptions

    @classmethod
    def check_options(cls, options: HttpOptions, key: str) -> None:
        if not options.url.startswith(("http://", "https://")):
            raise ValueError(f"{key}.url={options.url}: expected http://host:port or https://...")
        if options.timeout_s <= 0 or options.retries < 0 or options.backoff_s < 0 or options.max_backoff_s < 0:
            raise ValueError(f"{key}: timeout_s must be positive and retries, backoff_s, max_backoff_s >= 0")

    def setup(self) -> None:
        httpx, _ = import_client()
        self.client = httpx.Client(base_url=self.options.url.rstrip("/"), timeout=self.options.timeout_s)
        health = self.request("GET", "/health", lambda body: body)
        logger.info("reward '%s': server at %s serves %s", self.name, self.options.url, health.get("reward") if isinstance(health, dict) else health)

    def teardown(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
            self.client = None

    def score(self, images, prompts):
        return self.request("POST", "/score", lambda body: parse_scores(body, len(prompts)), json=score_request(images, prompts))

    def request(self, method: str, route: str, parse: Callable[[Any], Any], **kwargs) -> Any:
        """`parse(answer JSON)` of a request, retried as the module docstring says."""
        httpx, tenacity = import_client()
        options = self.options
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(options.retries + 1),
            wait=tenacity.wait_exponential(multiplier=options.backoff_s, max=options.max_backoff_s),
            retry=tenacity.retry_if_exception_type((httpx.TransportError, TransientAnswer)),
            before_sleep=lambda state: logger.warning(
                "reward '%s': %s %s%s failed (%s); try %d of %d",
                self.name, method, options.url, route, self.describe(state.outcome.exception()),
                state.attempt_number + 1, options.retries + 1,
            ),
            reraise=True,
        )
        where = f"reward '{self.name}': {method} {options.url.rstrip('/')}{route}"
        try:
            return retrying(self.attempt, method, route, parse, **kwargs)
        except (httpx.TransportError, TransientAnswer) as error:
            raise RewardUnavailable(
                f"{where} failed {options.retries + 1} times (reward.components.{self.name}.retries={options.retries}); "
                f"last: {self.describe(error)}"
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
            return f"no answer within {self.options.timeout_s} s (reward.components.{self.name}.timeout_s)"
        if isinstance(error, httpx.ConnectError):
            return f"cannot connect ({error})"
        if isinstance(error, httpx.TransportError):
            return f"the connection broke mid-request ({type(error).__name__}: {error})"
        return str(error)


REWARD = HttpReward
