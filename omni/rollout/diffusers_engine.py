"""The in-process rollout engine: a diffusers SD3 pipeline sampled with SDE log-probs.

Randomness is per image: image i draws its initial latent and every step's noise from a
generator seeded with seeds[i], so an image does not depend on how the batch is split
into micro-batches or across workers.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from omni.config.model import LoraConfig
from omni.models.sd3 import PromptEmbeds, decode_latents, encode_prompts, predict_velocity
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.sde import ode_step, sde_step
from omni.weights import add_lora_adapter, load_base_weights, load_lora_weights


class DiffusersEngine:
    def __init__(self, pipe, device: torch.device, micro_batch_size: int, has_base: bool = True):
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = pipe.transformer.eval().requires_grad_(False)
        # read once: a module's `.dtype` walks all its parameters on every access
        self.dtype = self.transformer.dtype
        self.device = device
        self.micro_batch_size = micro_batch_size
        self.has_base = has_base
        self.adapter_name: Optional[str] = None

    def sigmas(self, num_steps: int) -> torch.Tensor:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.float().clone()

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        sigmas = self.sigmas(options.num_steps)
        unique = list(dict.fromkeys(prompts))
        unique_cond = encode_prompts(self.pipe, unique, options.guidance_scale, options.max_sequence_length, self.device)
        index = torch.tensor([unique.index(p) for p in prompts], device=self.device)
        cond = unique_cond.apply(lambda t: t[index])
        chunks = [
            self._sample(cond.apply(lambda t: t[s : s + self.micro_batch_size]), seeds[s : s + self.micro_batch_size], sigmas, options)
            for s in range(0, len(prompts), self.micro_batch_size)
        ]
        latents, log_probs, images = (torch.cat(parts) for parts in zip(*chunks))
        return RolloutBatch(list(prompts), images, latents, log_probs, sigmas, cond.apply(lambda t: t.cpu()), options)

    def _sample(self, cond: PromptEmbeds, seeds, sigmas, options: SamplingOptions):
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        channels = self.transformer.config.in_channels
        size = options.resolution // self.pipe.vae_scale_factor
        draw = lambda: torch.stack([torch.randn(channels, size, size, generator=g) for g in generators]).to(self.device, self.dtype)  # noqa: E731
        x = draw()
        trajectory, log_probs = [x], []
        start, stop = options.sde_steps
        sigma_max = float(sigmas[1])
        for i in range(options.num_steps):
            sigma = sigmas[i].expand(len(seeds)).to(self.device)
            velocity = predict_velocity(self.transformer, x, sigma, cond, options.guidance_scale)
            if start <= i < stop:
                x, log_prob, _, _ = sde_step(velocity, x, sigmas[i], sigmas[i + 1], sigma_max, options.noise_level, noise=draw())
            else:
                x, log_prob = ode_step(velocity, x, sigmas[i], sigmas[i + 1]), torch.zeros(len(seeds), device=self.device)
            trajectory.append(x)
            log_probs.append(log_prob)
        images = decode_latents(self.pipe.vae, x, self.dtype)
        return torch.stack(trajectory, 1).cpu(), torch.stack(log_probs, 1).float().cpu(), images.cpu()

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> PromptEmbeds:
        cond = encode_prompts(self.pipe, list(prompts), guidance_scale, max_sequence_length, self.device)
        return cond.apply(lambda t: t.cpu())

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the transformer's latents (the VAE posterior's mode)."""
        vae = self.pipe.vae
        pixels = (images * 2 - 1).to(self.device, vae.dtype)
        latents = vae.encode(pixels).latent_dist.mode()
        return ((latents - vae.config.shift_factor) * vae.config.scaling_factor).cpu()

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
