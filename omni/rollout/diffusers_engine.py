"""The in-process rollout engine: a model family's diffusers pipeline sampled with SDE log-probs.

The sampling itself is `omni.rollout.sampling.sample_rollout`, shared with the vLLM-Omni
engine's pipeline, so both engines give the same trajectories for the same weights.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from omni.config.model import LoraConfig
from omni.models.base import Conditioning, ModelFamily
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.sampling import sample_rollout
from omni.weights import add_lora_adapter, load_base_weights, load_lora_weights


class DiffusersEngine:
    def __init__(self, family: ModelFamily, pipe, device: torch.device, micro_batch_size: int, has_base: bool = True):
        self.family = family
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = pipe.transformer.eval().requires_grad_(False)
        # read once: a module's `.dtype` walks all its parameters on every access
        self.dtype = self.transformer.dtype
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.has_base = has_base
        self.adapter_name: Optional[str] = None

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        return sample_rollout(self.family, self.pipe, prompts, seeds, options, self.micro_batch_size, self.device, self.dtype)

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        cond = self.family.encode_prompts(self.pipe, list(prompts), guidance_scale, max_sequence_length, self.device)
        return cond.apply(lambda t: t.cpu())

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the transformer's latents (the VAE posterior's mode)."""
        return self.family.encode_images(self.pipe, images, self.device)

    def update_weights(self, named_tensors: Dict[str, torch.Tensor], base_sync_done: bool, lora: Optional[LoraConfig]) -> None:
        """Base weights (base_sync_done False) or the LoRA of `lora.adapter_name`."""
        if not base_sync_done:
            load_base_weights(self.transformer, named_tensors)
            self.has_base = True
            return
        if not self.has_base:
            raise RuntimeError("the engine got LoRA weights before any base weights; sync the base first")
        if self.adapter_name is None:
            add_lora_adapter(self.transformer, lora)
            self.adapter_name = lora.adapter_name
        load_lora_weights(self.transformer, named_tensors, self.adapter_name)

    def shutdown(self) -> None:
        self.pipe = self.transformer = None


def load_diffusers_engine(family: ModelFamily, model_path, device: torch.device, dtype: torch.dtype, micro_batch_size: int, load_base: bool) -> DiffusersEngine:
    """An engine on the checkpoint at `model_path`; without `load_base`, its transformer is
    a dummy of the right shape that the first weight sync fills."""
    return DiffusersEngine(family, family.load_pipeline(model_path, dtype, load_base), device, micro_batch_size, has_base=load_base)


def build(cfg, family: ModelFamily, model_path: str, device: torch.device, dtype: torch.dtype) -> DiffusersEngine:
    """`rollout.engine=diffusers`."""
    return load_diffusers_engine(family, model_path, device, dtype, cfg.rollout.micro_batch_size, cfg.rollout.load_base)
