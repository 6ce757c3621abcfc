"""Online Diffusion-DPO: each prompt is sampled `group_size` times with the current policy,
and its best and worst image by reward form a pair (a group whose rewards all tie gives no
pair and is counted). With `reward.aggregation=gdpo` the images are ranked by GDPO's
advantages (omni/algorithms/advantages.py) instead of the weighted sum of their rewards, so
that each reward counts on the scale of its spread within the group. The pairs' final
latents train the LoRA with Diffusion-DPO's loss (`omni.algorithms.dpo`) against the same
transformer with adapters disabled.

    python recipes/train.py algorithm=online_dpo
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from omni.algorithms import dpo
from omni.algorithms.base import Algorithm, ScoredRollout, grouped_rollout, sync_engine
from omni.algorithms.flow_grpo import check_groups
from omni.config.reward import Aggregation
from omni.context import update_seed


@dataclass
class OnlineDPOConfig(dpo.DPOConfig):
    # Images sampled per prompt; its best and worst by reward form a pair.
    group_size: int = 8


def best_and_worst(rewards: torch.Tensor, group_size: int, tie_tolerance: float = 1e-8):
    """Per group of `group_size` consecutive samples: indices of its best and worst sample
    among those with a finite reward, for the groups whose rewards do not all tie; and the
    number of groups without a pair (tied, or fewer than two finite rewards)."""
    grouped = rewards.reshape(-1, group_size).float()
    finite = torch.isfinite(grouped)
    best = torch.where(finite, grouped, float("-inf")).argmax(dim=1)
    worst = torch.where(finite, grouped, float("inf")).argmin(dim=1)
    spread = grouped.gather(1, best[:, None]) - grouped.gather(1, worst[:, None])
    keep = (finite.sum(dim=1) >= 2) & (spread[:, 0] > tie_tolerance)
    offsets = torch.arange(len(grouped)) * group_size
    return (best + offsets)[keep], (worst + offsets)[keep], int((~keep).sum())


def ranking(rollout: ScoredRollout, group_size: int, aggregation) -> Tuple[torch.Tensor, Dict[str, float]]:
    """What the images of each group are ranked by: their reward, or with gdpo their GDPO
    advantage (NaN for an image without a finite reward, which is in no pair) -> (values, metrics)."""
    if Aggregation(aggregation) != Aggregation.gdpo:
        return rollout.scores["reward"], {}
    advantages, metrics = rollout.advantages(group_size, aggregation)
    return torch.where(rollout.valid, advantages, float("nan")), metrics


class OnlineDPO(Algorithm):
    Options = OnlineDPOConfig  # its options: schema/algorithm/online_dpo

    @classmethod
    def uses_reference(cls, cfg) -> bool:
        return True  # Diffusion-DPO's loss, as offline

    @classmethod
    def samples_stochastically(cls, cfg) -> bool:
        return True  # every step the SDE's

    @classmethod
    def check_config(cls, cfg) -> None:
        dpo.check_dpo(cfg.algorithm)
        check_groups(cfg.algorithm.group_size, cfg.trainer.batch_size)

    def step(self, step: int) -> Dict[str, float]:
        cfg, algo, worker = self.cfg, self.cfg.algorithm, self.ctx.worker
        rollout = grouped_rollout(self.ctx, step, algo.group_size, (0, cfg.rollout.num_steps))
        ranked, advantage_metrics = ranking(rollout, algo.group_size, cfg.reward.aggregation)
        chosen, rejected, ties = best_and_worst(ranked, algo.group_size)
        timings, metrics = dict(rollout.timings), {}
        if len(chosen):
            tick = time.perf_counter()
            x0 = rollout.batch.latents[:, -1]
            pairs = dpo.PairBatch(x0[chosen], x0[rejected], rollout.batch.cond.apply(lambda t: t[chosen]))
            metrics = worker.apply_update(dpo.update, pairs, update_seed(cfg.seed, step))
            timings["time/update"] = time.perf_counter() - tick
            timings.update(sync_engine(worker))
        return {
            **rollout.reward_metrics(),
            **advantage_metrics,
            "train/pairs": float(len(chosen)),
            "train/tied_groups": float(ties),
            **{f"train/{k}": v for k, v in metrics.items()},
            **timings,
        }


ALGORITHM = OnlineDPO
