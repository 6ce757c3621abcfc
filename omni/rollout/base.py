"""The rollout engine interface, shared by the in-process diffusers engine and vLLM-Omni.

An engine samples images with SDE steps and reports what the actor needs to re-score them
(the latent trajectory, per-step log-probs, the noise levels and the text embeddings). It
keeps its own inference copy of the transformer, updated only through `update_weights`
with tensors from `omni.fsdp_utils.collect_lora_params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from omni.config.model import LoraConfig
from omni.models.sd3 import PromptEmbeds


@dataclass
class SamplingOptions:
    num_steps: int
    resolution: int
    guidance_scale: float
    noise_level: float
    max_sequence_length: int
    # Steps [start, stop) sampled with the SDE and scored; the others are ODE steps.
    sde_steps: Tuple[int, int]


@dataclass
class RolloutBatch:
    prompts: List[str]
    images: torch.Tensor  # (B, 3, H, W) in [0, 1]
    latents: torch.Tensor  # (B, T + 1, C, h, w): x_T ... x_0
    log_probs: torch.Tensor  # (B, T); 0 on ODE steps
    sigmas: torch.Tensor  # (T + 1,) noise level of each latent
    cond: PromptEmbeds
    options: SamplingOptions

    def __len__(self) -> int:
        return len(self.prompts)


class RolloutEngine(Protocol):
    # Whether the engine holds the base weights (loaded itself, or received in a sync).
    has_base: bool

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch: ...

    def update_weights(
        self, named_tensors: Dict[str, torch.Tensor], base_sync_done: bool, lora: Optional[LoraConfig]
    ) -> None: ...

    def shutdown(self) -> None: ...
