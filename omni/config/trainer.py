"""Schema of the `trainer` group: steps, batch sizes, optimiser, workers, cadences."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainerConfig:
    steps: int = 20
    # Images per step over all workers (prompts per step = batch_size / group_size).
    batch_size: int = 32
    # Samples per actor forward/backward; gradients are accumulated over the batch.
    micro_batch_size: int = 8
    lr: float = 3e-4
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    device: str = "auto"
    n_workers: int = 1
    nnodes: int = 1
    n_gpus_per_node: int = 0
    ray_address: Optional[str] = None
    # Evaluate on held-out prompts and seeds before training, every N steps and at the end.
    eval_every: int = 0
    eval_images_per_prompt: int = 4
    eval_seed: int = 12345
    # Checkpoint every N steps (0: only at the end).
    save_every: int = 0
    # A checkpoint directory to continue from, or "auto" for the latest in output_dir.
    resume: Optional[str] = None
    progress_bar: bool = True
