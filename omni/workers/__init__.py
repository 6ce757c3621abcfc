"""The actor-rollout worker: one in this process, or a group of them on Ray.

`build_actor_rollout` chooses by `trainer.n_workers`: 1 keeps the worker in the driver's
process (no Ray, so the default CPU run starts in seconds); more start a Ray worker group
(`omni.workers.ray_group`) with the same methods: both implement `ActorRollout`
(`omni.workers.protocol`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from omni.workers.errors import ResourcesUnavailable, WorkerFailure

if TYPE_CHECKING:
    from omni.workers.protocol import ActorRollout

__all__ = ["ResourcesUnavailable", "WorkerFailure", "build_actor_rollout"]


def build_actor_rollout(
    cfg, model_path: str, keep_reference: bool = False, snapshots: Sequence[str] = ()
) -> ActorRollout:
    """A set-up `ActorRolloutWorker` (n_workers=1) or `ActorRolloutGroup` (n_workers > 1);
    `keep_reference`: the algorithm scores under the reference; `snapshots`: the frozen
    adapters it scores under (see the worker)."""
    if cfg.trainer.n_workers > 1:
        from omni.workers.ray_group import ActorRolloutGroup

        return ActorRolloutGroup(cfg, model_path, keep_reference, snapshots)
    from omni.workers.actor_rollout import ActorRolloutWorker

    check_local_gpus(cfg.trainer)
    worker = ActorRolloutWorker(cfg, model_path, keep_reference=keep_reference, snapshots=snapshots)
    worker.setup()
    return worker


def check_local_gpus(trainer) -> None:
    import torch

    if trainer.n_gpus_per_node > torch.cuda.device_count():
        raise ResourcesUnavailable(
            f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} but this machine shows "
            f"{torch.cuda.device_count()} CUDA device(s); set trainer.n_gpus_per_node=0 to run on the CPU"
        )
