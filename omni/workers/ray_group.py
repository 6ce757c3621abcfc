"""N actor-rollout workers as a Ray worker group (verl's single controller), driven through
`ActorRolloutGroup`, a facade with the worker's own method names (`ActorRollout`, in
`omni.workers.protocol`): the trainer and the algorithms run the same code with one
in-process worker or with the group.

Each worker is an `ActorRolloutWorker` (its FSDP shard of the actor, its own rollout engine)
inside `RayActorRolloutWorker`, a thin verl `Worker`. Rollouts split prompts and seeds over
the workers and join the parts; updates give every worker an equal shard of the batch and
the algorithm's update function to run on it (FSDP averages the gradients); weight sync,
checkpoint collection and restore run on every worker, since collecting from FSDP is
collective, and rank 0's whole tensors come back. A worker that fails stops the group at
once (the others would wait in a collective forever): the driver kills the workers and
raises `WorkerFailure` naming it.
"""

from __future__ import annotations

import copy
import itertools
import os
from typing import Callable, Dict, List, Sequence

import ray
import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, Execute, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, SubRayResourcePool

import omni.workers.ray_cluster as ray_cluster
from omni.models.base import Conditioning
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.workers.actor_rollout import ActorRolloutWorker
from omni.workers.batching import equal_shards, mean_metrics, split_evenly
from omni.workers.errors import WorkerFailure

# Tests only: "<rank>:<n>" makes that worker's process exit during its n-th update.
CRASH_HOOK_ENV = "OMNI_TEST_CRASH_WORKER_AT_UPDATE"
SHUTDOWN_TIMEOUT_S = 60
GROUP_NUMBERS = itertools.count()


class RayActorRolloutWorker(Worker):
    """One `ActorRolloutWorker` in a Ray actor; rank and world size come from verl's group."""

    def __init__(self, cfg, model_path: str, keep_reference: bool = False, snapshots: Sequence[str] = ()):
        super().__init__()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # Ray shows each actor its own GPU only
        self.worker = ActorRolloutWorker(
            cfg, model_path, self.rank, self.world_size, local_rank, keep_reference, snapshots
        )
        self.updates = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def setup(self) -> None:
        self.worker.setup()

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def generate(self, prompts: List[str], seeds: List[int], options: SamplingOptions):
        return self.worker.generate(prompts, seeds, options) if prompts else None

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def apply_update(self, update: Callable, batch, seed: int, first: int = 0, total: int = 0):
        self.updates += 1
        if os.environ.get(CRASH_HOOK_ENV) == f"{self.rank}:{self.updates}":
            os._exit(1)
        return self.worker.apply_update(update, batch, seed, first, total)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def evaluate_batch(self, evaluate: Callable, batch, seed: int):
        return self.worker.evaluate_batch(evaluate, batch, seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sync_weights(self) -> Dict[str, float]:
        return self.worker.sync_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def set_lr(self, lr: float) -> float:
        return self.worker.set_lr(lr)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def lora_state_dict(self):
        lora = self.worker.lora_state_dict()
        return lora if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def trained_state_dict(self):
        weights = self.worker.trained_state_dict()
        return weights if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def optimizer_state_dict(self):
        state = self.worker.optimizer_state_dict()
        return state if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load_state(self, weights: Dict[str, torch.Tensor], optimizer_state: dict) -> None:
        self.worker.load_state(weights, optimizer_state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load_adapter(self, lora: Dict[str, torch.Tensor]) -> None:
        self.worker.load_adapter(lora)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        self.worker.load_weights(weights)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def load_snapshot(self, name: str, lora: Dict[str, torch.Tensor]) -> None:
        self.worker.load_snapshot(name, lora)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.worker.encode_images(images)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO, blocking=False)
    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        return self.worker.encode_prompts(prompts, guidance_scale, max_sequence_length)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def shutdown(self) -> None:
        self.worker.shutdown()


class ActorRolloutGroup:
    """`trainer.n_workers` workers on Ray, with the methods of one `ActorRolloutWorker`."""

    def __init__(self, cfg, model_path: str, keep_reference: bool = False, snapshots: Sequence[str] = ()):
        self.cfg = cfg
        self.keep_reference, self.snapshots = keep_reference, tuple(snapshots)
        self.workers: RayWorkerGroup | None = None
        self.placement_groups: list = []
        self.connected = ray_cluster.connect(cfg.trainer.ray_address)
        try:
            layout = ray_cluster.worker_layout(cfg.trainer)
            ray_cluster.check_resources(cfg.trainer, layout)
            self.placement_groups = ray_cluster.reserve(layout, cfg.trainer.placement_timeout_s)
            self.workers = self._start_workers(layout, model_path)
            self._gather("setup", self.workers.setup())
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, layout: ray_cluster.WorkerLayout, model_path: str) -> RayWorkerGroup:
        # the placement groups reserved with a timeout (verl's own wait has none), handed in
        # through the constructor verl offers for placement groups that already exist
        pool = SubRayResourcePool(
            placement_groups=self.placement_groups, start_bundle_index=0,
            subgroup_world_size=sum(layout.workers_per_node),
            process_on_nodes=layout.workers_per_node, use_gpu=layout.use_gpu, max_colocate_count=1,
        )  # fmt: skip
        cfg = copy.deepcopy(self.cfg)
        if not layout.use_gpu:
            cfg.trainer.device = "cpu"  # "auto" must not pick a GPU that Ray did not reserve
        worker_class = RayClassWithInitArgs(
            ray.remote(RayActorRolloutWorker), cfg, model_path, self.keep_reference, self.snapshots
        )
        crash_hook = {CRASH_HOOK_ENV: os.environ[CRASH_HOOK_ENV]} if CRASH_HOOK_ENV in os.environ else {}
        device = "cuda" if layout.use_gpu else "cpu"
        # a name of its own: a run may hold two groups (training and async rollout), a process several runs
        prefix = f"omni_{os.getpid()}_{next(GROUP_NUMBERS)}_"
        return RayWorkerGroup(pool, worker_class, name_prefix=prefix, device_name=device, worker_env=crash_hook)

    @property
    def world_size(self) -> int:
        return self.workers.world_size

    # ----------------------------------------------------------------- calls
    def _gather(self, method: str, futures: list) -> list:
        """The workers' results in rank order; on the first failure, stop the group and raise."""
        rank_of = {ref: rank for rank, ref in enumerate(futures)}
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as error:
                rank, error = self._root_failure(rank_of, done[0], error, pending)
                name = self.workers.worker_names[rank]
                self._kill_workers()
                raise WorkerFailure(
                    f"actor-rollout worker rank {rank} of {len(futures)} ({name}) failed in {method}: {_reason(error)}"
                ) from None
        return ray.get(futures)

    @staticmethod
    def _root_failure(rank_of: dict, ref, error, pending: list, grace_s: float = 5.0):
        """(rank, error) of the failure to report: a worker whose process died, if one did
        within `grace_s`, before the others' collectives that broke because of it (a peer's
        'Connection reset' can reach the driver first)."""
        if isinstance(error, ray.exceptions.RayActorError) or not pending:
            return rank_of[ref], error
        finished, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        for other in finished:
            try:
                ray.get(other)
            except ray.exceptions.RayActorError as died:
                return rank_of[other], died
            except ray.exceptions.RayError:
                continue
        return rank_of[ref], error

    def call_rank_zero(self, method: str, *args):
        return self._gather(method, [getattr(self.workers, method)(*args)])[0]

    # ----------------------------------------------------------------- the worker's methods
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        parts = split_evenly(len(prompts), self.world_size)
        futures = self.workers.generate(
            [list(prompts[p]) for p in parts], [list(seeds[p]) for p in parts], [options] * self.world_size
        )
        return RolloutBatch.cat([b for b in self._gather("generate", futures) if b is not None])

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.call_rank_zero("encode_images", images)

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        return self.call_rank_zero("encode_prompts", list(prompts), guidance_scale, max_sequence_length)

    def apply_update(self, update: Callable, batch, seed: int) -> Dict[str, float]:
        """Each worker runs `update` on an equal shard of the batch. Rows past the last
        multiple of the worker count (online DPO's pair count varies) sit this update out
        and are counted in `rows_unused`."""
        used = len(batch) - len(batch) % self.world_size
        metrics: Dict[str, float] = {}
        if used:
            shards = equal_shards(used, self.world_size)
            futures = self.workers.apply_update(
                [update] * self.world_size, [batch.select(s) for s in shards],
                [seed] * self.world_size, [s.start for s in shards], [used] * self.world_size,
            )  # fmt: skip
            metrics = mean_metrics(self._gather("apply_update", futures))
        if used < len(batch):
            metrics["rows_unused"] = float(len(batch) - used)
        return metrics

    def evaluate_batch(self, evaluate: Callable, batch, seed: int) -> Dict[str, float]:
        return self._gather("evaluate_batch", self.workers.evaluate_batch(evaluate, batch, seed))[0]

    def sync_weights(self) -> Dict[str, float]:
        """The slowest worker's seconds; of the parity gate's figures, each worker checks its
        own engine: the worst of theirs."""
        per_worker = self._gather("sync_weights", self.workers.sync_weights())
        parity = {key: max(m[key] for m in per_worker) for key in per_worker[0] if key.startswith("sync/parity_")}
        return {
            "sync/seconds": max(m["sync/seconds"] for m in per_worker),
            "sync/megabytes": per_worker[0]["sync/megabytes"],
            **parity,
        }

    def set_lr(self, lr: float) -> float:
        return self._gather("set_lr", self.workers.set_lr(lr))[0]

    def lora_state_dict(self) -> Dict[str, torch.Tensor]:
        return self._gather("lora_state_dict", self.workers.lora_state_dict())[0]

    def trained_state_dict(self) -> Dict[str, torch.Tensor]:
        return self._gather("trained_state_dict", self.workers.trained_state_dict())[0]

    def optimizer_state_dict(self) -> dict:
        return self._gather("optimizer_state_dict", self.workers.optimizer_state_dict())[0]

    def load_state(self, weights: Dict[str, torch.Tensor], optimizer_state: dict) -> None:
        # one copy in the object store for all workers
        self._gather("load_state", self.workers.load_state(ray.put(weights), ray.put(optimizer_state)))

    def load_adapter(self, lora: Dict[str, torch.Tensor]) -> None:
        self._gather("load_adapter", self.workers.load_adapter(ray.put(lora)))

    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        self._gather("load_weights", self.workers.load_weights(ray.put(weights)))

    def load_snapshot(self, name: str, lora: Dict[str, torch.Tensor]) -> None:
        self._gather("load_snapshot", self.workers.load_snapshot(name, ray.put(lora)))

    # ----------------------------------------------------------------- shutdown
    def _kill_workers(self) -> None:
        for worker in self.workers.workers if self.workers else []:
            ray.kill(worker, no_restart=True)
        self.workers = None

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force), free their placement, and stop Ray if
        this group started it."""
        if self.workers is not None:
            try:
                ray.get(self.workers.shutdown(), timeout=SHUTDOWN_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # killed below either way
            self._kill_workers()
        ray_cluster.release(self.placement_groups)
        self.placement_groups = []
        ray_cluster.disconnect(self.connected)
        self.connected = False


def _reason(error: ray.exceptions.RayError, limit: int = 300) -> str:
    """The cause's last line for a raised exception; Ray's first line and exit line for a
    dead process."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    if isinstance(error, ray.exceptions.RayTaskError):
        return lines[-1][:limit]
    reason = " ".join(lines[:1] + [line for line in lines[1:] if "exit" in line.lower()][:1])
    return reason if len(reason) <= limit else reason[:limit] + "..."
