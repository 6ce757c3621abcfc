"""Asynchronous rollout (`trainer.rollout_mode=async`): a Ray group of rollout workers samples
and scores the next steps' batches while the trainer updates on this one.

The trainer's own worker (in this process, or its group) only trains. After update k its
trained weights, collected with `collect_lora_params` (`trained_state_dict`: the LoRA, or with
full fine-tuning the whole transformer), are published as weights version k + 1. The
rollout of step j is submitted when the trainer takes batch j - max_staleness, pinned to the
newest version at that moment, and runs on a background thread (sampling on the rollout
group's Ray workers, scoring here) while the update runs:

    take(k): submit the rollouts of steps up to k + max_staleness, each pinned to version k;
             wait for step k's batch (sampled with version k - staleness).

So a batch's staleness is exactly `max_staleness` after the first steps (fewer at the start:
version 0 is the initial weights), and with `max_staleness=0` every batch is sampled with the
weights the update starts from, as in the synchronous loop, on the same seeds: the run is the
synchronous one. Pinning each rollout to a version (rather than to whatever weights the
rollout workers hold when it starts) keeps a run repeatable whatever the threads' timing.

Off-policy correction: the update's importance ratio is taken against the behaviour policy's
log-probs stored with the batch (the rollout group's, of the pinned version), and clipped by
the algorithm's `clip_range`, as PPO does with a stale buffer; no second ratio to the current
weights (decoupled PPO) is needed at a bound of a few updates, since the clip already bounds
the step from the behaviour policy; DiffusionNFT needs no log-probs at all (its anchor v_old is
the update's starting weights). What assumes that the update starts from the rollout's
weights is switched off for a stale batch (Flow-GRPO's reuse of the rollout's unconditional
velocities). Algorithms whose loss compares with the rollout's step means under the current
weights (GRPO-Guard, Flow-DPPO) or grow their rollout from the update (TreeGRPO, GARDO) are
refused at validation (`Algorithm.supports_async`).

A checkpoint keeps the weights versions its pending rollouts are pinned to, so a resumed run
redoes those rollouts from their seeds with the same weights and continues exactly.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Dict, Optional, Tuple

import torch

from omni.config.errors import require


def check_config(cfg, algorithm) -> None:
    """What `trainer.rollout_mode=async` needs, before any model loads; `algorithm`: the run's
    `Algorithm` class."""
    trainer = cfg.trainer
    if trainer.rollout_mode != "async":
        return
    mode = "trainer.rollout_mode=async"
    require(
        algorithm.supports_async,
        f"{mode} with algorithm.name={cfg.algorithm.name}: its update needs a batch sampled with the weights it "
        "starts from; use flow_grpo, flow_grpo_fast, mix_grpo or diffusion_nft, or trainer.rollout_mode=sync",
    )
    engine = getattr(cfg.rollout.engine, "value", cfg.rollout.engine)
    require(
        engine == "diffusers",
        f"{mode} with rollout.engine={engine}: the rollout workers sample in-process (diffusers); "
        "set rollout=diffusers or trainer.rollout_mode=sync",
    )
    require(
        not (cfg.sentinel.enabled and getattr(cfg.sentinel.action, "value", cfg.sentinel.action) == "rollback"),
        f"{mode} with sentinel.action=rollback: a rollback would leave rollouts sampled ahead with the weights "
        "it discards; use sentinel.action=warn or stop, or trainer.rollout_mode=sync",
    )


def check_cluster(trainer) -> None:
    """Fail, naming the keys, when the Ray cluster cannot hold the rollout workers and the
    training workers (on Ray when more than one) together, each one CPU (and one GPU on GPU runs)."""
    import ray

    from omni.workers.errors import ResourcesUnavailable

    training = trainer.n_workers if trainer.n_workers > 1 else 0
    workers = trainer.rollout_workers + training
    need = {"CPU": workers, **({"GPU": workers} if trainer.n_gpus_per_node > 0 else {})}
    have = ray.cluster_resources()
    if all(have.get(key, 0) >= amount for key, amount in need.items()):
        return
    raise ResourcesUnavailable(
        f"trainer.rollout_mode=async: trainer.rollout_workers={trainer.rollout_workers} rollout workers and "
        f"{training} training workers on Ray (trainer.n_workers={trainer.n_workers}; one trains in this process) "
        f"need {need}, but the Ray cluster has {{'CPU': {have.get('CPU', 0):g}, 'GPU': {have.get('GPU', 0):g}}}. "
        "Lower trainer.rollout_workers or trainer.n_workers, or add machines (ray start --address=...) and "
        "attach with trainer.ray_address"
    )


def rollout_group_config(cfg):
    """The config of the rollout group: `trainer.rollout_workers` workers on one node (one GPU
    each on GPU runs), the rest of the run's settings unchanged."""
    rollout_cfg = copy.deepcopy(cfg)
    trainer = rollout_cfg.trainer
    gpus = cfg.trainer.n_gpus_per_node > 0
    trainer.n_workers, trainer.nnodes = cfg.trainer.rollout_workers, 1
    trainer.n_gpus_per_node = cfg.trainer.rollout_workers if gpus else 0
    return rollout_cfg


class AsyncRollouts:
    """Rollouts sampled ahead by a Ray group, each pinned to a published weights version."""

    def __init__(self, ctx, rollout: Callable, model_path: str, group=None):
        """`rollout(ctx, step)`: the algorithm's scored rollout of `step` on a context;
        `group`: the rollout workers (`ActorRolloutGroup`), built from the run's config if None."""
        self.cfg = ctx.cfg
        self.max_staleness = self.cfg.trainer.max_staleness
        self.owns_group = group is None  # a group handed in is closed by whoever made it
        self.connected = False
        self.group = group if group is not None else self.start_group(model_path)
        # the rollout thread's context: the rollout group samples, nothing is logged from the thread
        self.ctx = replace(ctx, worker=self.group, logger=None)
        self.rollout = rollout
        self.version = 0  # updates done: the newest weights version
        self.weights: Dict[int, Dict[str, torch.Tensor]] = {}
        self.loaded: Optional[int] = None  # the version the rollout group holds
        self.pending: Dict[int, Tuple[int, Future]] = {}  # step -> (version, its scored rollout)
        self.submitted = -1  # the last step submitted
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-rollout")

    def start_group(self, model_path: str):
        """Attach to Ray (or start it), check that the cluster holds the rollout and training
        workers, then start the rollout group."""
        from omni.workers import ray_cluster
        from omni.workers.ray_group import ActorRolloutGroup

        self.connected = ray_cluster.connect(self.cfg.trainer.ray_address)
        try:
            check_cluster(self.cfg.trainer)
            return ActorRolloutGroup(rollout_group_config(self.cfg), model_path)
        except BaseException:
            ray_cluster.disconnect(self.connected)
            raise

    def publish(self, version: int, weights: Dict[str, torch.Tensor]) -> None:
        """Weights version `version` (the trained weights after `version` updates); versions no
        pending or future rollout is pinned to are dropped."""
        self.version = version
        self.weights[version] = {name: t.detach().clone() for name, t in weights.items()}
        needed = {v for v, _ in self.pending.values()} | {version}
        for old in [v for v in self.weights if v not in needed]:
            del self.weights[old]

    def _sample(self, step: int, version: int):
        if self.loaded != version:
            self.group.load_weights(self.weights[version])
            self.loaded = version
        return self.rollout(self.ctx, step)

    def submit_through(self, last_step: int) -> None:
        for step in range(self.submitted + 1, last_step + 1):
            self.pending[step] = (self.version, self.thread.submit(self._sample, step, self.version))
            self.submitted = step

    def take(self, step: int):
        """Step `step`'s scored rollout (`omni.algorithms.base.ScoredRollout`) and its staleness
        (updates between its weights and the update's), after submitting the rollouts up to
        `step + max_staleness`; a step never submitted (a run's first, or after resume) is now."""
        if self.submitted < step:
            self.submitted = step - 1
        self.submit_through(min(step + self.max_staleness, self.cfg.trainer.steps - 1))
        version, future = self.pending.pop(step)
        tick = time.perf_counter()
        scored = future.result()
        waited = time.perf_counter() - tick
        staleness = self.version - version
        if staleness and scored.batch.uncond_velocities is not None:
            # reused only by an update that starts from the rollout's weights
            scored.batch.uncond_velocities = None
        # time/rollout and time/reward ran beside the update; this is what the trainer waited
        scored.timings = {**scored.timings, "time/rollout_wait": waited}
        return scored, staleness

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, object]:
        """The weights versions the submitted, not yet taken rollouts are pinned to (by step)."""
        return {
            "pinned": {step: version for step, (version, _) in self.pending.items()},
            "weights": {v: w for v, w in self.weights.items() if v != self.version},
        }

    def load_state_dict(self, state: Dict[str, object], step: int, current: Dict[str, torch.Tensor]) -> None:
        """Resume at `step` with the checkpoint's weights `current` (version `step`): the pinned
        rollouts are submitted again, in order, with the weights they had."""
        self.version = step
        self.weights = {int(v): w for v, w in state["weights"].items()}
        self.weights[step] = {name: t.detach().clone() for name, t in current.items()}
        self.submitted = step - 1
        for pinned_step, version in sorted((int(s), int(v)) for s, v in state["pinned"].items()):
            self.pending[pinned_step] = (version, self.thread.submit(self._sample, pinned_step, version))
            self.submitted = pinned_step

    def close(self) -> None:
        for _, future in self.pending.values():
            future.cancel()
        self.thread.shutdown(wait=True)
        self.pending.clear()
        if self.owns_group:
            from omni.workers import ray_cluster

            self.group.shutdown()
            ray_cluster.disconnect(self.connected)
