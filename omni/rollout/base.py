"""The rollout engine interface, shared by the in-process diffusers engine and vLLM-Omni.

An engine samples images with SDE steps and reports what the actor needs to re-score them
(the latent trajectory, per-step log-probs, the noise levels and the text embeddings). It
samples with the actor's own transformer (in process) or keeps its own inference copy,
updated only through `update_weights` with tensors from `omni.fsdp_utils.collect_lora_params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from omni.config.model import LoraConfig
from omni.models.base import Conditioning


@dataclass
class SamplingOptions:
    num_steps: int
    resolution: int
    guidance_scale: float
    noise_level: float
    max_sequence_length: int
    # Steps [start, stop) sampled with the SDE and scored; the others are ODE steps.
    sde_steps: Tuple[int, int]
    # The stochastic step: "sde" (Flow-GRPO) or "cps" (omni.rollout.sde).
    sde_type: str = "sde"
    # The solver of the ODE steps: "euler" or "dpm2" (omni.rollout.ode).
    ode_solver: str = "euler"
    # Frames per clip of a video family (1 for images).
    num_frames: int = 1
    # TreeGRPO's tree: (denoising step, children) at each branch point, in step order; the
    # rows come in groups of the tree's leaves, one prompt and seed per group, and the branch
    # steps are the only SDE steps (`sde_steps` unused). (): independent samples.
    tree: Tuple[Tuple[int, int], ...] = ()
    # Rows share their initial noise in groups of this many, each row's seed made by
    # `omni.seeding.group_member_seeds` (rollout.initial_noise=per_group); 1: each its own.
    initial_noise_group: int = 1


def run_sampling_options(cfg, sde_steps: Tuple[int, int] = (0, 0)) -> SamplingOptions:
    """The run's sampling (`rollout.*`, `model.max_sequence_length`) with SDE steps [start,
    stop); (0, 0): the deterministic ODE sampling of evaluation."""
    rollout = cfg.rollout
    return SamplingOptions(
        num_steps=rollout.num_steps,
        resolution=rollout.resolution,
        guidance_scale=rollout.guidance_scale,
        noise_level=rollout.noise_level,
        max_sequence_length=cfg.model.max_sequence_length,
        sde_steps=sde_steps,
        sde_type=rollout.sde_type.value,
        ode_solver=rollout.ode_solver.value,
        num_frames=rollout.num_frames,
    )


@dataclass
class RolloutBatch:
    prompts: List[str]
    images: Optional[torch.Tensor]  # (B, 3, H, W), clips (B, F, 3, H, W), in [0, 1]; None in an update's shard
    latents: torch.Tensor  # (B, T + 1, *latent): x_T ... x_0 in the family's layout
    log_probs: torch.Tensor  # (B, T); 0 on ODE steps
    sigmas: torch.Tensor  # (T + 1,) noise level of each latent
    cond: Conditioning  # the model family's text conditioning, one row per image
    options: SamplingOptions
    # (B, SDE steps, *latent) fp32: classifier-free guidance's unconditional velocity at each
    # SDE step, kept when the update reuses it (algorithm.cfg_gradient=conditional); else None
    uncond_velocities: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: slice, with_images: bool = True) -> "RolloutBatch":
        """Rows `rows` as a batch of its own; copies, so that sending it to a worker sends
        only these rows (a view would carry its whole buffer). An update needs no images."""
        return RolloutBatch(
            prompts=self.prompts[rows],
            images=self.images[rows].clone() if with_images and self.images is not None else None,
            latents=self.latents[rows].clone(),
            log_probs=self.log_probs[rows].clone(),
            sigmas=self.sigmas,
            cond=self.cond.apply(lambda t: t[rows].clone()),
            options=self.options,
            uncond_velocities=None if self.uncond_velocities is None else self.uncond_velocities[rows].clone(),
        )

    @staticmethod
    def cat(parts: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """One batch from several, in order."""
        first = parts[0]
        return RolloutBatch(
            prompts=[prompt for p in parts for prompt in p.prompts],
            images=torch.cat([p.images for p in parts]),
            latents=torch.cat([p.latents for p in parts]),
            log_probs=torch.cat([p.log_probs for p in parts]),
            sigmas=first.sigmas,
            cond=type(first.cond).cat([p.cond for p in parts]),
            options=first.options,
            uncond_velocities=None
            if any(p.uncond_velocities is None for p in parts)
            else torch.cat([p.uncond_velocities for p in parts]),
        )


class RolloutEngine(Protocol):
    # Whether the engine holds the base weights (loaded itself, or received in a sync).
    has_base: bool
    # Whether it samples with the actor's own transformer (then no sync is needed).
    shares_actor: bool
    # After a LoRA sync, the modules (plain names) its adapter is bound to; None when it
    # cannot tell (the parity gate, omni/rollout/parity.py, compares them with the actor's).
    lora_modules: Optional[List[str]]

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch: ...

    def encode_prompts(
        self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int
    ) -> Conditioning: ...

    def encode_images(self, images: torch.Tensor) -> torch.Tensor: ...

    def update_weights(
        self, named_tensors: Dict[str, torch.Tensor], base_sync_done: bool, lora: Optional[LoraConfig]
    ) -> None: ...

    def shutdown(self) -> None: ...
