"""Scoring a rollout part by part, each part while the next is sampled.

`StreamedScores` takes the images of a rollout part by part (`add`, from the sampling
thread) and scores each part on one background thread while the next part is sampled;
`result` waits for the last part's scores. A part is scored exactly as
`WeightedReward.__call__(images, prompts, part=<part size>)` scores it (each component in
calls of at most its batch size), so the scores equal those of sampling the whole rollout
and then scoring it, bit for bit, whatever the reward.

Sampling and scoring overlap when the reward leaves the Python interpreter free while it
works: a server (http, vlm_judge), a model on another device, torch's own kernels.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Sequence

import torch


class StreamedScores:
    """The scores of `total` images given in order by `add`; use as a context manager."""

    def __init__(self, reward, total: int):
        self.reward, self.total = reward, total  # an omni.rewards.WeightedReward
        self.arrived = 0
        self.busy_s = 0.0  # seconds the background thread spent scoring
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reward")
        self.futures: List[Future] = []

    def __enter__(self) -> "StreamedScores":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def add(self, images: torch.Tensor, prompts: Sequence[str]) -> None:
        """The next part's images and prompts; its scoring starts in the background. A part
        whose scoring failed already is raised here, so sampling stops early."""
        for future in self.futures:
            if future.done() and future.exception() is not None:
                raise future.exception()
        if self.arrived + len(images) > self.total:
            raise ValueError(f"{self.arrived + len(images)} images added to a stream of {self.total}")
        self.arrived += len(images)
        self.futures.append(self.pool.submit(self._score, images, list(prompts)))

    def _score(self, images: torch.Tensor, prompts: List[str]) -> Dict[str, torch.Tensor]:
        tick = time.perf_counter()
        try:
            return self.reward.component_scores(images, prompts)
        finally:
            self.busy_s += time.perf_counter() - tick

    def result(self) -> Dict[str, torch.Tensor]:
        """{"reward": weighted sum, <name>: component}, once every image has been added and scored."""
        if self.arrived != self.total:
            raise ValueError(f"{self.arrived} of {self.total} images were added")
        return self.reward.combine([future.result() for future in self.futures])
