"""A Flow-GRPO step: prompts -> SDE rollout -> reward -> group advantages -> clipped-ratio
update of the LoRA -> weight sync into the rollout engine."""

from __future__ import annotations

import time
from typing import Dict

from omni.algorithms import flow_grpo
from omni.data.prompts import items_for_step


class FlowGRPOStep:
    def __init__(self, trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg

    def __call__(self, step: int) -> Dict[str, float]:
        from omni.trainer import step_seeds

        cfg, algo, worker = self.cfg, self.cfg.algorithm, self.trainer.worker
        timings, tick = {}, time.perf_counter()
        prompts = items_for_step(self.trainer.train_prompts, step, cfg.trainer.batch_size // algo.group_size, cfg.seed)
        prompts = [p for p in prompts for _ in range(algo.group_size)]
        batch = worker.generate(prompts, step_seeds(cfg.seed, step, len(prompts)), self.trainer.sampling_options(step))
        timings["time/rollout"], tick = time.perf_counter() - tick, time.perf_counter()
        scores = self.trainer.reward_fn(batch.images, prompts)
        advantages = flow_grpo.group_advantages(scores["reward"], algo.group_size, algo.global_std)
        advantages = flow_grpo.clip_advantages(advantages, algo.adv_clip_max)
        timings["time/reward"], tick = time.perf_counter() - tick, time.perf_counter()
        metrics = worker.update(batch, advantages, seed=cfg.seed * 15_485_863 + step)
        timings["time/update"] = time.perf_counter() - tick
        timings["time/sync"] = worker.sync_weights()["sync/seconds"]
        self.trainer.maybe_log_images(batch.images, step)
        return {
            **self.trainer.means(scores, "reward/"),
            "reward/std": float(scores["reward"].std()),
            **{f"train/{k}": v for k, v in metrics.items()},
            **timings,
        }
