"""Schema of the `trainer` group: steps, batch sizes, optimiser, workers, cadences (the
evaluation's is the `eval` group's, omni/config/eval.py)."""

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from omni.config.errors import require

# trainer.rollout_mode (a str: OmegaConf reads an enum by member name, and `async` is a keyword)
ROLLOUT_MODES = ("sync", "async")


class Optimizer(str, Enum):
    adamw = "adamw"
    sgd = "sgd"  # plain SGD (no momentum): its step is the gradient, scaled by the lr


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
    optimizer: Optimizer = Optimizer.adamw
    # Clip the global gradient norm to this (0: no clipping; the norm is logged either way).
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
    # sync: sample, then update, each step. async: `rollout_workers` Ray workers sample the next
    # steps with weights at most `max_staleness` updates old while the trainer's workers update
    # (omni/async_rollout.py); max_staleness=0 is the synchronous run, on separate workers.
    rollout_mode: str = "sync"
    max_staleness: int = 1
    rollout_workers: int = 1
    # How long to wait for Ray to place the workers before failing (others hold the resources).
    placement_timeout_s: float = 120.0
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
    # Only evaluate (the initial or resumed policy; the `eval` group says how) and exit;
    # trainer.steps is not used.
    eval_only: bool = False
    progress_bar: bool = True

    def __post_init__(self) -> None:
        """The rules on this group's own fields (see RolloutConfig.__post_init__); a resumed
        checkpoint's match with the model is omni.validation's."""
        require(
            self.eval_only or self.steps >= 1,
            f"trainer.steps={self.steps}: a run trains at least 1 step; to only evaluate, set trainer.eval_only=true",
        )
        require(
            self.ema_decay is None or 0 < self.ema_decay < 1,
            f"trainer.ema_decay={self.ema_decay} must be in (0, 1) (the weight of the previous average), "
            "or null for no EMA",
        )
        require(self.max_bad_steps >= 1, f"trainer.max_bad_steps={self.max_bad_steps} must be >= 1")
        require(
            self.keep_last_checkpoints is None or self.keep_last_checkpoints >= 1,
            f"trainer.keep_last_checkpoints={self.keep_last_checkpoints} must be >= 1, "
            "or null to keep every checkpoint",
        )
        require(self.lr > 0, f"trainer.lr={self.lr} must be positive")
        require(
            self.eval_only or 0 <= self.warmup_steps < self.steps,
            f"trainer.warmup_steps={self.warmup_steps} must be in [0, trainer.steps={self.steps})",
        )
        require(self.batch_size > 0, f"trainer.batch_size={self.batch_size} must be positive")
        require(self.micro_batch_size > 0, f"trainer.micro_batch_size={self.micro_batch_size} must be positive")
        require(self.max_grad_norm >= 0, f"trainer.max_grad_norm={self.max_grad_norm} must be >= 0")
        require(self.n_workers >= 1, f"trainer.n_workers={self.n_workers} must be >= 1")
        require(
            self.batch_size % self.n_workers == 0,
            f"trainer.batch_size={self.batch_size} does not split evenly over trainer.n_workers={self.n_workers}",
        )
        self._check_layout()
        self._check_rollout_mode()

    def _check_layout(self) -> None:
        """Workers, nodes and GPUs that describe one layout (see omni.workers.ray_cluster)."""
        workers, nodes, gpus = self.n_workers, self.nnodes, self.n_gpus_per_node
        require(
            nodes >= 1 and gpus >= 0, f"trainer.nnodes={nodes} must be >= 1 and trainer.n_gpus_per_node={gpus} >= 0"
        )
        if gpus > 0:
            require(
                workers == nodes * gpus,
                f"trainer.n_workers={workers}: one worker per GPU, so trainer.nnodes={nodes} x "
                f"trainer.n_gpus_per_node={gpus} = {nodes * gpus}; set trainer.n_workers={nodes * gpus}",
            )
            require(self.device != "cpu", f"trainer.device=cpu but trainer.n_gpus_per_node={gpus}; set one of them")
        else:
            require(
                workers % nodes == 0, f"trainer.n_workers={workers} does not split evenly over trainer.nnodes={nodes}"
            )
            require(
                workers == 1 or self.device != "cuda",
                f"trainer.device=cuda with trainer.n_gpus_per_node=0: Ray gives the {workers} workers no GPU; "
                f"set trainer.n_gpus_per_node",
            )
        require(
            self.ray_address is None or workers > 1 or self.rollout_mode == "async",
            f"trainer.ray_address={self.ray_address} with trainer.n_workers=1: one worker runs in this process "
            f"without Ray; set trainer.n_workers > 1 to use the cluster",
        )
        require(
            self.placement_timeout_s > 0, f"trainer.placement_timeout_s={self.placement_timeout_s} must be positive"
        )

    def _check_rollout_mode(self) -> None:
        require(
            self.rollout_mode in ROLLOUT_MODES,
            f"trainer.rollout_mode={self.rollout_mode} must be one of {', '.join(ROLLOUT_MODES)}",
        )
        require(self.max_staleness >= 0, f"trainer.max_staleness={self.max_staleness} must be >= 0")
        require(self.rollout_workers >= 1, f"trainer.rollout_workers={self.rollout_workers} must be >= 1")
        if self.rollout_mode == "async":
            require(
                self.batch_size % self.rollout_workers == 0,
                f"trainer.batch_size={self.batch_size} does not split evenly over "
                f"trainer.rollout_workers={self.rollout_workers}",
            )
