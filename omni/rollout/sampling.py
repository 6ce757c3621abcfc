"""The Flow-GRPO rollout sampler shared by every engine (in-process diffusers, vLLM-Omni).

Given a model family and its diffusers pipeline, it samples images with SDE steps (Flow-GRPO's,
or coefficients-preserving ones: `SamplingOptions.sde_type`) and
returns what the actor needs to re-score them. Both engines call `sample_rollout`, so they
produce the same latents and log-probs for the same weights, prompts and seeds.

Randomness is per image: image i draws its initial latent and every step's noise from a
generator seeded with seeds[i], so an image does not depend on how the batch is split
into micro-batches, across workers or across engine requests.

Whatever the transformer's dtype, the trajectory (initial latents, noise, every step) and the
log-probs are fp32: only the transformer's input is cast to its dtype, and its velocity comes
back as fp32, so a bf16 transformer does not round the numbers the importance ratio compares.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from omni.models.base import Conditioning, ModelFamily
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.sde import is_noisy_step, ode_step, sde_step


def encode_each_prompt(family: ModelFamily, pipe, prompts: Sequence[str], options: SamplingOptions, device) -> Conditioning:
    """Text embeddings per prompt; repeated prompts (a GRPO group) are encoded once."""
    position = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    unique_cond = family.encode_prompts(pipe, list(position), options.guidance_scale, options.max_sequence_length, device)
    index = torch.tensor([position[p] for p in prompts], device=device)
    return unique_cond.apply(lambda t: t[index])


@torch.no_grad()
def sample_trajectories(
    family: ModelFamily, pipe, cond: Conditioning, seeds: Sequence[int], sigmas: torch.Tensor, options: SamplingOptions, device, dtype
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch: (latents (B, T+1, ...), log_probs (B, T), images (B, 3, H, W)), fp32
    on the CPU. `dtype` is the transformer's, read once by the caller (reading a module's dtype
    walks all its parameters)."""
    transformer = pipe.transformer
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def draw() -> torch.Tensor:
        return family.initial_latents(pipe, generators, options.resolution).to(device, torch.float32)

    x = draw()
    trajectory, log_probs = [x], []
    start, stop = options.sde_steps
    sigma_max = float(sigmas[1])
    for i in range(options.num_steps):
        sigma = sigmas[i].expand(len(seeds)).to(device)
        velocity = family.predict_velocity(transformer, x.to(dtype), sigma, cond, options.guidance_scale)
        if start <= i < stop and is_noisy_step(options.sde_type, sigmas[i + 1]):
            x, log_prob, _, _ = sde_step(
                velocity, x, sigmas[i], sigmas[i + 1], sigma_max, options.noise_level, noise=draw(), sde_type=options.sde_type
            )
        else:
            x, log_prob = ode_step(velocity, x, sigmas[i], sigmas[i + 1]), torch.zeros(len(seeds), device=device)
        trajectory.append(x)
        log_probs.append(log_prob)
    images = family.decode(pipe, x, options.resolution)
    return torch.stack(trajectory, 1).cpu(), torch.stack(log_probs, 1).cpu(), images.cpu()


@torch.no_grad()
def sample_rollout(
    family: ModelFamily, pipe, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions, micro_batch_size: int, device, dtype
) -> RolloutBatch:
    """Sample every (prompt, seed) in micro-batches; the batch the actor re-scores."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    sigmas = family.sigmas(pipe, options.num_steps, options.resolution)
    cond = encode_each_prompt(family, pipe, prompts, options, device)
    chunks = [
        sample_trajectories(
            family,
            pipe,
            cond.apply(lambda t: t[s : s + micro_batch_size]),
            seeds[s : s + micro_batch_size],
            sigmas,
            options,
            device,
            dtype,
        )
        for s in range(0, len(prompts), micro_batch_size)
    ]
    latents, log_probs, images = (torch.cat(parts) for parts in zip(*chunks))
    return RolloutBatch(list(prompts), images, latents, log_probs, sigmas, cond.apply(lambda t: t.cpu()), options)
