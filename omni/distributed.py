"""torch.distributed set-up for the actor: gloo on CPU, NCCL on GPU, one group per run."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from omni.devices import disable_cudnn_attention


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        disable_cudnn_attention()
        return torch.device("cuda", local_rank)
    return torch.device(name)


# How long a collective waits for the other workers: one rank's rollout or reward can take
# minutes while the others wait in the update's first all-gather.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def init_process_group(rank: int, world_size: int, device: torch.device) -> None:
    """Join (or create, for a single worker) the default process group. On GPUs the group
    is bound to this worker's device (NCCL then sets up its communicator eagerly, on the
    right GPU, instead of guessing one at the first collective)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
