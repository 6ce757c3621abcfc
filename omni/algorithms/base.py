"""What an algorithm is, and the grouped rollout the online ones share.

An algorithm lives in `omni/algorithms/<name>.py` (`algorithm.name`) and defines
`ALGORITHM`, an `Algorithm` subclass. The driver side: `check_config` (cross-group rules,
before any model loads), `uses_reference` (whether it scores under the reference), the
`snapshot_adapters` (the frozen LoRA adapters beside the trained one that it scores under),
the constructor (reads its data, before any model loads), `setup` (once the worker exists),
`step` (one training step -> metrics), `evaluate` (held-out metrics of its own),
`state_dict` / `load_state_dict` (what a checkpoint keeps, such as a data position) and
`close`. The worker side: module-level functions `update(worker, batch, seed, first,
total)` that the worker runs on its shard of a batch with its primitives (velocity under
the policy or the reference, backward, optimizer step); a Ray group ships the function to
every worker, so adding an algorithm adds no worker method.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Tuple

import torch

from omni import seeding
from omni.algorithms.advantages import aggregated_advantages
from omni.config.algorithm import AlgorithmConfig
from omni.config.errors import ConfigError
from omni.config.rollout import InitialNoise
from omni.context import StepContext, means, step_seeds
from omni.data.prompts import items_for_step
from omni.rollout.base import RolloutBatch


class Algorithm:
    # The algorithm's options (an AlgorithmConfig subclass), stored as schema/algorithm/<name>.
    Options = AlgorithmConfig
    # Whether its batches may be sampled ahead with older weights (trainer.rollout_mode=async,
    # omni/async_rollout.py): its update reads the behaviour policy only through the log-probs
    # stored with the batch, and its rollout is `rollout(step, ctx)`.
    supports_async = False
    rollouts = None  # the run's AsyncRollouts with trainer.rollout_mode=async, set by the trainer

    def __init__(self, ctx: StepContext):
        self.ctx, self.cfg = ctx, ctx.cfg

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise omni.config.errors.ConfigError naming the keys of a rule this config breaks."""

    @classmethod
    def samples_stochastically(cls, cfg) -> bool:
        """Whether its grouped rollouts take SDE steps, so images that share their initial
        noise (rollout.initial_noise=per_group) still differ; ODE rollouts would make one image."""
        return False

    @classmethod
    def uses_reference(cls, cfg) -> bool:
        """Whether the update scores under the reference (`worker.velocity(..., reference=True)`):
        with full fine-tuning the worker then keeps a frozen copy of the initial transformer."""
        return False

    @classmethod
    def snapshot_adapters(cls, cfg) -> Tuple[str, ...]:
        """The frozen adapters the update scores under besides the reference (an EMA of the
        policy, a reference that moves: `omni.workers.actor_rollout`'s snapshots), added when
        the worker is built; the step sets them with `worker.load_snapshot`."""
        return ()

    def setup(self) -> None:
        """Work that needs the worker (e.g. encoding a data set once)."""

    def step(self, step: int) -> Dict[str, float]:
        raise NotImplementedError

    def next_rollout(self, step: int) -> Tuple["ScoredRollout", Dict[str, float]]:
        """Step `step`'s scored rollout: sampled now with the current weights, or taken from the
        rollouts sampled ahead (with its staleness, in updates, as a metric)."""
        if self.rollouts is None:
            return self.rollout(step), {}
        scored, staleness = self.rollouts.take(step)
        self.ctx.log_images(scored.batch.images, step)
        return scored, {"train/staleness": float(staleness)}

    def evaluate(self) -> Dict[str, float]:
        """Held-out metrics beyond the reward (e.g. DPO's implicit accuracy)."""
        return {}

    def state_dict(self) -> Dict[str, object]:
        """What a checkpoint keeps of the algorithm beyond the step (e.g. its data position)."""
        return {}

    def load_state_dict(self, state: Dict[str, object], step: int) -> None:
        """Restore `state_dict()` when resuming at `step` (empty for an older checkpoint)."""

    def close(self) -> None:
        """Release what `setup` opened (data loader workers)."""


def check_initial_noise(cfg, algorithm) -> None:
    """rollout.initial_noise=per_group: only for the in-process engine (an engine's requests
    carry a seed each, no group) and an algorithm whose group members part by SDE steps."""
    if cfg.rollout.initial_noise != InitialNoise.per_group:
        return
    key = "rollout.initial_noise=per_group"
    if not algorithm.samples_stochastically(cfg):
        raise ConfigError(
            f"{key}: algorithm={cfg.algorithm.name} samples its groups with the ODE, so a group's images "
            "would all be one image; use rollout.initial_noise=per_image"
        )
    if cfg.rollout.engine.value != "diffusers":
        raise ConfigError(
            f"{key}: rollout.engine={cfg.rollout.engine.value} seeds each request alone; shared initial "
            "noise is the in-process engine's (rollout=diffusers)"
        )


def sync_engine(worker) -> Dict[str, float]:
    """Sync the rollout engine with the trained weights: `time/sync`, and the parity gate's
    figures (`sync/parity_*`, omni/rollout/parity.py) when it checked this sync."""
    metrics = worker.sync_weights()
    return {"time/sync": metrics["sync/seconds"], **{k: v for k, v in metrics.items() if k.startswith("sync/parity_")}}


@dataclass
class ScoredRollout:
    prompts: List[str]
    batch: RolloutBatch
    scores: Dict[str, torch.Tensor]  # "reward" and each named component, one per image
    valid: torch.Tensor  # images whose reward is finite (the others sit the update out)
    weights: Dict[str, float]  # each component's weight, by its name in `scores`
    timings: Dict[str, float] = field(default_factory=dict)

    def advantages(self, group_size: int, aggregation, adv_norm="group") -> Tuple[torch.Tensor, Dict[str, float]]:
        """Each image's group advantage, the components summed as `reward.aggregation` says
        (omni.algorithms.advantages) -> (advantages, metrics)."""
        return aggregated_advantages(self.scores, self.weights, self.valid, group_size, aggregation, adv_norm)

    def reward_metrics(self) -> Dict[str, float]:
        kept = {name: values[self.valid] for name, values in self.scores.items()}
        dropped = {"reward/dropped_nonfinite": float((~self.valid).sum())} if not self.valid.all() else {}
        return {**means(kept, "reward/"), "reward/std": float(kept["reward"].std()), **dropped}


def grouped_rollout(
    ctx: StepContext, step: int, group_size: int, sde_steps: Tuple[int, int], tree: Tuple[Tuple[int, int], ...] = ()
) -> ScoredRollout:
    """Step `step`'s prompts, each sampled `group_size` times with the current policy, scored
    (while it is sampled, with `reward.overlap`). With a `tree` (`SamplingOptions.tree`) each
    group is one tree, grown from the seed of the group's first image; with
    `rollout.initial_noise=per_group`, a group's images start from one initial noise."""
    cfg = ctx.cfg
    prompts = items_for_step(ctx.train_prompts, step, cfg.trainer.batch_size // group_size, cfg.seed)
    prompts = [p for p in prompts for _ in range(group_size)]
    seeds = step_seeds(cfg.seed, step, len(prompts))
    options = replace(ctx.sampling_options(sde_steps), tree=tuple(tree))
    if tree:
        seeds = [s for s in seeds[::group_size] for _ in range(group_size)]
    elif cfg.rollout.initial_noise == InitialNoise.per_group:
        seeds = seeding.group_member_seeds(seeds[: len(prompts) // group_size], group_size)
        options = replace(options, initial_noise_group=group_size)
    batch, scores, timings = ctx.sample_and_score(prompts, seeds, options)
    valid = ctx.reward.finite(scores, f"training step {step + 1}")
    ctx.log_images(batch.images, step)
    return ScoredRollout(prompts, batch, scores, valid, ctx.reward.weights, timings)
