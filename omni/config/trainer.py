"""Schema of the `trainer` group: steps, batch sizes, optimiser, workers, cadences."""

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class LRSchedule(str, Enum):
    constant = "constant"
    linear = "linear"  # from trainer.lr down towards 0 at the last step
    cosine = "cosine"  # half a cosine from trainer.lr down towards 0


@dataclass
class TrainerConfig:
    steps: int = 50
    # Images per step over all workers (prompts per step = batch_size / group_size).
    batch_size: int = 32
    # Samples per actor forward/backward; gradients are accumulated over the batch.
    micro_batch_size: int = 8
    lr: float = 3e-4
    # The learning rate over the steps (omni/schedules.py): after `warmup_steps` steps that
    # ramp up linearly to trainer.lr, `lr_schedule` takes it down (or keeps it).
    lr_schedule: LRSchedule = LRSchedule.constant
    warmup_steps: int = 0
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    device: str = "auto"
    # GiB one device may hold: validation estimates the run's peak per device (omni/memory.py,
    # from the transformer's config alone) and refuses a run above it, naming the settings that
    # drive it. None: a CUDA device's total memory; on the CPU, no check. A generous value
    # overrides an estimate you know to be pessimistic.
    device_memory_gib: Optional[float] = None
    # Actor-rollout workers, data-parallel. 1: in the driver's process, no Ray. More: a Ray
    # worker group (FSDP over the workers, one rollout engine each); on GPUs one worker per
    # GPU, so n_workers = nnodes * n_gpus_per_node.
    n_workers: int = 1
    nnodes: int = 1
    n_gpus_per_node: int = 0
    # A running Ray cluster to attach to ("auto", or host:port of its head); None: start a
    # local Ray instance for the run (only when n_workers > 1).
    ray_address: Optional[str] = None
    # How long to wait for Ray to place the workers before failing (others hold the resources).
    placement_timeout_s: float = 120.0
    # Evaluate on held-out prompts and seeds before training, every N steps and at the end.
    eval_every: int = 0
    eval_images_per_prompt: int = 4
    eval_seed: int = 12345
    # Checkpoint every N steps (0: only at the end).
    save_every: int = 0
    # Keep only the newest N checkpoints this run (and the run it continues, in its own
    # directory) saved; older ones are deleted after each save. None: keep every checkpoint.
    # Checkpoints of another run (one resumed from elsewhere) are never deleted.
    keep_last_checkpoints: Optional[int] = None
    # A checkpoint directory to continue from, or "auto" for the newest intact one in output_dir.
    resume: Optional[str] = None
    # Stop after this many steps in a row whose gradient was not finite (their optimizer
    # steps are skipped, so the weights stay as they were).
    max_bad_steps: int = 3
    # Exponential moving average of the LoRA, updated after every step (omni/ema.py); when set,
    # evaluations and exported checkpoints use the average. None: off.
    ema_decay: Optional[float] = None
    # Only evaluate (the initial or resumed policy) and exit; trainer.steps is not used.
    eval_only: bool = False
    progress_bar: bool = True
