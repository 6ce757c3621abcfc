"""A reward scored by a server elsewhere (`reward=http`): GenEval in its own environment, a
big judge on its own GPUs, or any reward of ours behind `python -m omni.rewards.serve`.

Each `score` call is one POST /score carrying the batch (PNG images, prompts and their
metadata; see `omni.rewards.protocol` and docs/reward_server.md), retried with backoff as
`omni.rewards.retrying` says; when it still fails, `RewardUnavailable` names the reward, the
URL and the last failure (the trainer adds the training step). A failed request never
becomes a score. `setup` asks /health first, so a server that is not there stops the run
before any diffusion model loads. `required_metadata` names the metadata keys each prompt
must carry (GenEval's `tag` and `include`), checked at validation. Needs the `reward-http` extra.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omni.rewards.base import Reward
from omni.rewards.protocol import parse_scores, score_request
from omni.rewards.retrying import RemoteOptions, RetryingClient, check_remote_options, served_by

logger = logging.getLogger(__name__)


@dataclass
class HttpOptions(RemoteOptions):
    # url: the reward server's base URL, e.g. http://reward-host:8000 (routes /health and /score).
    # Metadata keys every prompt must have for the served reward (e.g. [tag, include] for GenEval).
    required_metadata: List[str] = field(default_factory=list)


class HttpReward(Reward):
    Options = HttpOptions

    @classmethod
    def check_options(cls, options: HttpOptions, key: str) -> None:
        check_remote_options(options, key)

    @classmethod
    def prompt_problem(cls, options: HttpOptions, prompt: Any) -> Optional[str]:
        missing = [k for k in options.required_metadata if k not in getattr(prompt, "metadata", {})]
        return (
            f"metadata {missing} (reward.components.http.required_metadata; a JSONL prompt file has them)"
            if missing
            else None
        )

    def source(self) -> str:
        return served_by(self.options)

    def setup(self) -> None:
        self.client = RetryingClient(self.name, self.options, f"reward.components.{self.name}")
        health = self.client.request("GET", "/health", lambda body: body)
        logger.info(
            "reward '%s': server at %s serves %s",
            self.name,
            self.options.url,
            health.get("reward") if isinstance(health, dict) else health,
        )

    def teardown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None

    def score(self, images, prompts):
        return self.client.request(
            "POST", "/score", lambda body: parse_scores(body, len(prompts)), json=score_request(images, prompts)
        )


REWARD = HttpReward
