"""A Flow-GRPO step: prompts -> SDE rollout -> reward -> group advantages -> clipped-ratio
update of the LoRA -> weight sync into the rollout engine."""

from __future__ import annotations

import time
from typing import Dict

from omni.algorithms import flow_grpo
from omni.steps.grouped_rollout import grouped_rollout


class FlowGRPOStep:
    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg

    def __call__(self, step: int) -> Dict[str, float]:
        cfg, algo, worker = self.cfg, self.cfg.algorithm, self.trainer.worker
        rollout = grouped_rollout(self.trainer, step, algo.group_size)
        advantages = flow_grpo.group_advantages(rollout.scores["reward"], algo.group_size, algo.global_std)
        advantages = flow_grpo.clip_advantages(advantages, algo.adv_clip_max)
        tick = time.perf_counter()
        metrics = worker.update(rollout.batch, advantages, seed=cfg.seed * 15_485_863 + step)
        timings = {**rollout.timings, "time/update": time.perf_counter() - tick}
        timings["time/sync"] = worker.sync_weights()["sync/seconds"]
        return {**rollout.reward_metrics(self.trainer), **{f"train/{k}": v for k, v in metrics.items()}, **timings}
