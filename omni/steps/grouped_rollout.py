"""The rollout half of the online steps (Flow-GRPO, online DPO): the step's prompts, each
sampled `group_size` times with the current policy, and their rewards."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from omni.data.prompts import items_for_step
from omni.rollout.base import RolloutBatch


@dataclass
class ScoredRollout:
    prompts: List[str]
    batch: RolloutBatch
    scores: Dict[str, torch.Tensor]  # "reward" and each named component, one per image
    timings: Dict[str, float] = field(default_factory=dict)

    def reward_metrics(self, trainer) -> Dict[str, float]:
        return {**trainer.means(self.scores, "reward/"), "reward/std": float(self.scores["reward"].std())}


def grouped_rollout(trainer, step: int, group_size: int) -> ScoredRollout:
    from omni.trainer import step_seeds

    cfg = trainer.cfg
    tick = time.perf_counter()
    prompts = items_for_step(trainer.train_prompts, step, cfg.trainer.batch_size // group_size, cfg.seed)
    prompts = [p for p in prompts for _ in range(group_size)]
    batch = trainer.worker.generate(prompts, step_seeds(cfg.seed, step, len(prompts)), trainer.sampling_options(step))
    rollout_s, tick = time.perf_counter() - tick, time.perf_counter()
    scores = trainer.reward_fn(batch.images, prompts)
    trainer.maybe_log_images(batch.images, step)
    return ScoredRollout(prompts, batch, scores, {"time/rollout": rollout_s, "time/reward": time.perf_counter() - tick})
