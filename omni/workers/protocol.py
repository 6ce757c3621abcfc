"""`ActorRollout`: what the trainer and an algorithm's step call on the actor-rollout worker.

Three classes implement it: `ActorRolloutWorker` (one worker in the driver's process),
`RayActorRolloutWorker` (that worker inside a Ray actor, called by the group) and
`ActorRolloutGroup` (N workers on Ray behind the same methods). The names do not reuse the
trainer's or the algorithm's: the trainer `train`s and `evaluate`s, the worker
`apply_update`s an algorithm's update function and `evaluate_batch`es its evaluation
function; a family `load_lora`s a file, the worker `load_adapter`s tensors.

The primitives an update function uses on the in-process worker (`velocity`, `backward`,
`optimizer_step`, ...) are not part of this protocol: they run where the shard lives.
"""

from __future__ import annotations

from typing import Callable, Dict, Protocol, Sequence, runtime_checkable

import torch

from omni.models.base import Conditioning
from omni.rollout.base import RolloutBatch, SamplingOptions


@runtime_checkable
class ActorRollout(Protocol):
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        """Sample one image (or video) per prompt with its seed, with log-probs and trajectory."""

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        """The family's conditioning of `prompts` (offline DPO encodes its pairs' prompts)."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] to the latents the transformer sees."""

    def apply_update(self, update: Callable, batch, seed: int) -> Dict[str, float]:
        """Run an algorithm's `update(worker, batch, seed, first, total)` on the batch
        (sharded over a group); its metrics."""

    def evaluate_batch(self, evaluate: Callable, batch, seed: int) -> Dict[str, float]:
        """Run an algorithm's `evaluate(worker, batch, seed)` without gradients; its metrics."""

    def sync_weights(self) -> Dict[str, float]:
        """Push the trained weights into the rollout engine; `sync/seconds`, `sync/megabytes`."""

    def set_lr(self, lr: float) -> float:
        """Set the optimizer's learning rate; returns it as set."""

    def lora_state_dict(self) -> Dict[str, torch.Tensor]:
        """The LoRA as whole CPU tensors in PEFT naming."""

    def trained_state_dict(self) -> Dict[str, torch.Tensor]:
        """What trains (the LoRA, or the whole transformer) as whole CPU tensors."""

    def optimizer_state_dict(self) -> dict:
        """The optimizer's full state (for checkpoints)."""

    def load_state(self, weights: Dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """Restore the trained weights and the optimizer (a resumed checkpoint), then sync."""

    def load_adapter(self, lora: Dict[str, torch.Tensor]) -> None:
        """Set the LoRA tensors (PEFT names, as `lora_state_dict` returns them), then sync."""

    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        """Set the trained weights (as `trained_state_dict` returns them), then sync."""

    def load_snapshot(self, name: str, lora: Dict[str, torch.Tensor]) -> None:
        """Set the frozen snapshot adapter `name` to these LoRA tensors (no sync)."""

    def shutdown(self) -> None:
        """Stop the engine and leave the process group."""
