"""Diffusion-DPO steps: offline, from a preference-pair file, and online, from rollouts.

Offline: the pairs' images are VAE-encoded and their prompts text-encoded once, at set-up;
a share of the pairs is held out to measure implicit accuracy. Online: each prompt is
sampled `group_size` times with the current policy and its best and worst image by reward
form a pair (a group whose rewards all tie gives no pair and is counted). Both update the
LoRA with the Diffusion-DPO loss against the same transformer with adapters disabled, then
sync the rollout engine.
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch
from tqdm import tqdm

from omni.data.preferences import PreferencePair, images_to_tensor, load_preference_pairs
from omni.data.prompts import items_for_step
from omni.models.sd3 import PromptEmbeds
from omni.steps.grouped_rollout import grouped_rollout

ENCODE_CHUNK = 32


def split_pairs(pairs: List[PreferencePair], eval_fraction: float, seed: int):
    """A seeded split into (train, held-out) pairs; at least one pair on each side."""
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(max(1, round(len(pairs) * eval_fraction)), len(pairs) - 1) if eval_fraction > 0 else 0
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


class EncodedPairs:
    """Latents of the chosen and rejected images and the prompts' embeddings, on the CPU."""

    def __init__(self, pairs: List[PreferencePair], engine, options, progress: bool):
        chosen, rejected, conds = [], [], []
        chunks = range(0, len(pairs), ENCODE_CHUNK)
        for start in tqdm(chunks, desc="encoding pairs", disable=not progress or len(chunks) < 2):
            chunk = pairs[start : start + ENCODE_CHUNK]
            chosen.append(engine.encode_images(images_to_tensor([p.chosen for p in chunk], options.resolution)))
            rejected.append(engine.encode_images(images_to_tensor([p.rejected for p in chunk], options.resolution)))
            conds.append(engine.encode_prompts([p.prompt for p in chunk], 1.0, options.max_sequence_length))
        self.chosen, self.rejected = torch.cat(chosen), torch.cat(rejected)
        self.cond = PromptEmbeds.cat(conds)

    def __len__(self) -> int:
        return len(self.chosen)

    def select(self, index: torch.Tensor):
        return self.chosen[index], self.rejected[index], self.cond.apply(lambda t: t[index])


class OfflineDPOStep:
    def __init__(self, trainer):
        """Reads and checks the pairs (before any model loads)."""
        cfg = trainer.cfg
        self.trainer, self.cfg = trainer, cfg
        pairs, stats = load_preference_pairs(cfg.data.pairs, "data.pairs", skip_bad_rows=cfg.data.skip_bad_rows)
        self.data_stats = {f"data/{k}": float(v) for k, v in stats.items()}
        self.split = split_pairs(pairs, cfg.data.pairs_eval_fraction, cfg.seed)

    def setup(self) -> None:
        """Encodes the pairs once with the worker's VAE and text encoders."""
        train, held_out = self.split
        engine, options, progress = self.trainer.worker.engine, self.trainer.sampling_options(None), self.cfg.trainer.progress_bar
        self.train_pairs = EncodedPairs(train, engine, options, progress)
        self.eval_pairs = EncodedPairs(held_out, engine, options, progress) if held_out else None

    def __call__(self, step: int) -> Dict[str, float]:
        cfg, worker = self.cfg, self.trainer.worker
        tick = time.perf_counter()
        index = torch.tensor(items_for_step(list(range(len(self.train_pairs))), step, cfg.trainer.batch_size, cfg.seed))
        metrics = worker.dpo_update(*self.train_pairs.select(index), seed=cfg.seed * 15_485_863 + step)
        update = time.perf_counter() - tick
        sync = worker.sync_weights()["sync/seconds"]
        return {**{f"train/{k}": v for k, v in metrics.items()}, "time/update": update, "time/sync": sync, **self.data_stats}

    def evaluate(self) -> Dict[str, float]:
        """Implicit accuracy and margin on the held-out pairs (fixed noise levels and noise)."""
        if self.eval_pairs is None:
            return {}
        everything = torch.arange(len(self.eval_pairs))
        metrics = self.trainer.worker.dpo_evaluate(*self.eval_pairs.select(everything), seed=self.cfg.trainer.eval_seed)
        return {f"eval/{k}": v for k, v in metrics.items() if k in ("loss", "implicit_accuracy", "reward_margin")}


def best_and_worst(rewards: torch.Tensor, group_size: int, tie_tolerance: float = 1e-8):
    """Per group of `group_size` consecutive samples: indices of its best and worst sample,
    for the groups whose rewards do not all tie; and the number of tied groups."""
    grouped = rewards.reshape(-1, group_size)
    best, worst = grouped.argmax(dim=1), grouped.argmin(dim=1)
    spread = grouped.max(dim=1).values - grouped.min(dim=1).values
    keep = spread > tie_tolerance
    offsets = torch.arange(len(grouped)) * group_size
    return (best + offsets)[keep], (worst + offsets)[keep], int((~keep).sum())


class OnlineDPOStep:
    def __init__(self, trainer):
        self.trainer, self.cfg = trainer, trainer.cfg

    def __call__(self, step: int) -> Dict[str, float]:
        cfg, algo, worker = self.cfg, self.cfg.algorithm, self.trainer.worker
        rollout = grouped_rollout(self.trainer, step, algo.group_size)
        chosen, rejected, ties = best_and_worst(rollout.scores["reward"], algo.group_size)
        timings, metrics = dict(rollout.timings), {}
        if len(chosen):
            tick = time.perf_counter()
            x0 = rollout.batch.latents[:, -1]
            cond = rollout.batch.cond.apply(lambda t: t[chosen])
            metrics = worker.dpo_update(x0[chosen], x0[rejected], cond, seed=cfg.seed * 15_485_863 + step)
            timings["time/update"] = time.perf_counter() - tick
            timings["time/sync"] = worker.sync_weights()["sync/seconds"]
        return {
            **rollout.reward_metrics(self.trainer),
            "train/pairs": float(len(chosen)),
            "train/tied_groups": float(ties),
            **{f"train/{k}": v for k, v in metrics.items()},
            **timings,
        }
