"""The Flow-GRPO rollout sampler shared by every engine (in-process diffusers, vLLM-Omni).

Given a model family and its diffusers pipeline, it samples images with SDE steps (Flow-GRPO's,
or coefficients-preserving ones: `SamplingOptions.sde_type`) inside the SDE window and ODE
steps elsewhere (Euler's or DPM-Solver++(2M)'s: `SamplingOptions.ode_solver`), and
returns what the actor needs to re-score them (the SDE steps; ODE steps have log-prob 0).
The in-process engine and the `vllm` backend's pipeline call `sample_rollout`; the `native`
backend runs vLLM-Omni's own denoising loop, whose scheduler
(`omni.rollout.native_scheduler.FlowGRPOScheduler`) takes its steps with `rollout_step`, the
step `sample_trajectories` takes. So every engine produces the same latents and log-probs
for the same weights, prompts and seeds.

Randomness is per image: image i draws its initial latent and every step's noise from a
generator seeded with seeds[i], so an image does not depend on how the batch is split
into micro-batches, across workers or across engine requests.

Whatever the transformer's dtype, the trajectory (initial latents, noise, every step) and the
log-probs are fp32: only the transformer's input is cast to its dtype, and its velocity comes
back as fp32, so a bf16 transformer does not round the numbers the importance ratio compares.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Optional, Sequence, Tuple

import torch

from omni.data.prompts import source_images
from omni.models.base import Conditioning, ModelFamily
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.ode import ODESolver
from omni.rollout.sde import is_noisy_step, sde_step
from omni.rollout.tree import sample_trees
from omni.seeding import group_seed


class PromptCache:
    """Each prompt's text conditioning, encoded once and kept on the CPU (the most recent
    `size` prompts), so the text encoders run only for prompts not seen lately.

    With `offload`, the text encoders live on the CPU and visit the device only to encode:
    a large encoder (T5-XXL, 9.5 GB in bf16) does not hold device memory for a whole run to
    encode a few unchanging prompts."""

    def __init__(self, family: ModelFamily, pipe, device, offload: bool, size: int = 1024):
        self.family, self.pipe, self.device = family, pipe, torch.device(device)
        self.offload = offload and self.device.type != "cpu"
        self.size = size
        self.rows: OrderedDict = OrderedDict()
        self.encoded = 0  # prompts the text encoders have run on (for tests and logs)

    def encoders(self):
        return [
            getattr(self.pipe, name) for name in self.family.text_encoders if getattr(self.pipe, name, None) is not None
        ]

    def place_encoders(self) -> None:
        """Put the text encoders where they stay between encodings."""
        for encoder in self.encoders():
            encoder.to("cpu" if self.offload else self.device)

    @contextlib.contextmanager
    def _encoders_on_device(self):
        if not self.offload:
            yield
            return
        for encoder in self.encoders():
            encoder.to(self.device)
        try:
            yield
        finally:
            for encoder in self.encoders():
                encoder.to("cpu")

    def encode(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        """One row per prompt (repeats allowed, a GRPO group), on the device."""
        # a family encodes the negative prompt exactly when its guidance takes a second pass
        negative = self.family.forward_passes(guidance_scale) > 1
        # an edit's conditioning also depends on its source images, not on its text alone
        keys = [(p, source_images(p), negative, max_sequence_length) for p in prompts]
        missing = [k for k in dict.fromkeys(keys) if k not in self.rows]
        if missing:
            with self._encoders_on_device():
                new = self.family.encode_prompts(
                    self.pipe, [k[0] for k in missing], guidance_scale, max_sequence_length, self.device
                )
            self.encoded += len(missing)
            for i, key in enumerate(missing):
                self.rows[key] = new.apply(lambda t, i=i: t[i : i + 1].cpu())
        for key in keys:
            self.rows.move_to_end(key)
        cond = type(self.rows[keys[0]]).cat([self.rows[k] for k in keys]).apply(lambda t: t.to(self.device))
        while len(self.rows) > self.size:
            self.rows.popitem(last=False)
        return cond


def rollout_step(
    velocity: torch.Tensor,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    i: int,
    options: SamplingOptions,
    ode: ODESolver,
    draw: Callable[[], torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step `i` of a rollout from the fp32 latent `x` with the fp32 `velocity`: (the next
    latent, its log-prob per image). Inside the SDE window (`options.sde_steps`) a stochastic
    step ("sde" or "cps") whose noise is `draw()`, after which the ODE solver forgets its
    history (its next step starts from where the SDE left the latent); elsewhere, and on a
    CPS step to sigma 0, the ODE solver's step, log-prob 0. `sigmas`: the schedule, fp32 on
    the CPU. Both samplers step with this: `sample_trajectories` and the native backend's
    `FlowGRPOScheduler.step`."""
    start, stop = options.sde_steps
    if start <= i < stop and is_noisy_step(options.sde_type, sigmas[i + 1]):
        x, log_prob, _, _ = sde_step(
            velocity, x, sigmas[i], sigmas[i + 1], float(sigmas[1]), options.noise_level,
            noise=draw(), sde_type=options.sde_type,
        )  # fmt: skip
        ode.reset()
        return x, log_prob
    return ode.step(velocity, x, sigmas[i], sigmas[i + 1]), torch.zeros(len(x), device=x.device)


@torch.no_grad()
def sample_trajectories(
    family: ModelFamily,
    pipe,
    cond: Conditioning,
    seeds: Sequence[int],
    sigmas: torch.Tensor,
    options: SamplingOptions,
    device,
    dtype,
    keep_uncond: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One micro-batch: (latents (B, T+1, ...), log_probs (B, T), images (B, 3, H, W) or clips
    (B, F, 3, H, W), and with `keep_uncond` the unconditional velocities of the SDE steps
    (B, SDE steps, ...), else None), fp32 on the CPU; keeping them runs the same passes
    (`ModelFamily.guided_velocity`). `dtype` is the transformer's, read once by the caller
    (reading a module's dtype walks all its parameters)."""
    transformer = pipe.transformer
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def draw() -> torch.Tensor:
        return family.initial_latents(pipe, generators, options.resolution, options.num_frames).to(
            device, torch.float32
        )

    x = draw()
    if options.initial_noise_group > 1:  # the group's noise; each row's own generator, having
        # drawn its initial latent as always, keeps its SDE noise what a per-image run draws
        shared = [torch.Generator().manual_seed(group_seed(int(s), options.initial_noise_group)) for s in seeds]
        x = family.initial_latents(pipe, shared, options.resolution, options.num_frames).to(device, torch.float32)
    trajectory, log_probs, unconds = [x], [], []
    start, stop = options.sde_steps
    ode = ODESolver(options.ode_solver)
    for i in range(options.num_steps):
        sigma = sigmas[i].expand(len(seeds)).to(device)
        if keep_uncond and start <= i < stop:
            velocity, uncond = family.guided_velocity(transformer, x.to(dtype), sigma, cond, options.guidance_scale)
            unconds.append(uncond.cpu())
        else:
            velocity = family.predict_velocity(transformer, x.to(dtype), sigma, cond, options.guidance_scale)
        x, log_prob = rollout_step(velocity, x, sigmas, i, options, ode, draw)
        trajectory.append(x)
        log_probs.append(log_prob)
    images = family.decode(pipe, x, options.resolution)
    uncond = torch.stack(unconds, 1) if unconds else None
    return torch.stack(trajectory, 1).cpu(), torch.stack(log_probs, 1).cpu(), images.cpu(), uncond


@torch.no_grad()
def rescore_log_probs(family: ModelFamily, transformer, batch: RolloutBatch, dtype) -> torch.Tensor:
    """Each SDE step's log-prob of `batch`'s own trajectory under `transformer` (an actor's
    re-scoring, outside a worker: the family's velocity on the stored latents cast to the
    transformer's `dtype`, the step in fp32), (B, T) on the CPU, 0 outside the SDE window.
    exp(this - batch.log_probs) is the importance ratio an update starts from."""
    opts, device = batch.options, next(transformer.parameters()).device
    cond = batch.cond.apply(lambda t: t.to(device, dtype if t.is_floating_point() else t.dtype))
    out = torch.zeros(len(batch), opts.num_steps)
    start, stop = opts.sde_steps
    for i in range(start, stop):
        x = batch.latents[:, i].to(device)
        velocity = family.predict_velocity(
            transformer, x.to(dtype), batch.sigmas[i].expand(len(x)).to(device), cond, opts.guidance_scale
        )
        _, log_prob, _, _ = sde_step(
            velocity, x, batch.sigmas[i], batch.sigmas[i + 1], float(batch.sigmas[1]), opts.noise_level,
            next_sample=batch.latents[:, i + 1].to(device), sde_type=opts.sde_type,
        )  # fmt: skip
        out[:, i] = log_prob.cpu()
    return out


@torch.no_grad()
def sample_rollout(
    family: ModelFamily,
    pipe,
    prompts: Sequence[str],
    seeds: Sequence[int],
    options: SamplingOptions,
    micro_batch_size: int,
    device,
    dtype,
    prompt_cache: Optional[PromptCache] = None,
    keep_uncond: bool = False,
) -> RolloutBatch:
    """Sample every (prompt, seed) in micro-batches; the batch the actor re-scores (the
    prompts encoded through `prompt_cache`, or a cache for this call only); with
    `options.tree`, each group of rows is one tree (omni.rollout.tree). `keep_uncond`:
    under classifier-free guidance with two passes, the batch keeps the unconditional
    velocity of each SDE step (`RolloutBatch.uncond_velocities`)."""
    prompt_cache = prompt_cache or PromptCache(family, pipe, device, offload=False)
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    sigmas = family.sigmas(pipe, options.num_steps, options.resolution)
    cond = prompt_cache.encode(prompts, options.guidance_scale, options.max_sequence_length)
    cond = family.complete_conditioning(pipe, cond, options.resolution, options.num_frames)
    if options.tree:  # TreeGRPO's groups, each one tree (keeps no unconditional velocities)
        latents, log_probs, images = sample_trees(
            family, pipe, prompts, seeds, cond, sigmas, options, micro_batch_size, device, dtype
        )
        return RolloutBatch(list(prompts), images, latents, log_probs, sigmas, cond.apply(lambda t: t.cpu()), options)
    start, stop = options.sde_steps
    keep_uncond = keep_uncond and stop > start and family.forward_passes(options.guidance_scale) == 2
    chunks = [
        sample_trajectories(
            family,
            pipe,
            cond.apply(lambda t, s=s: t[s : s + micro_batch_size]),
            seeds[s : s + micro_batch_size],
            sigmas,
            options,
            device,
            dtype,
            keep_uncond,
        )
        for s in range(0, len(prompts), micro_batch_size)
    ]
    latents, log_probs, images = (torch.cat(parts) for parts in list(zip(*chunks))[:3])
    uncond = torch.cat([chunk[3] for chunk in chunks]) if keep_uncond else None
    return RolloutBatch(
        list(prompts), images, latents, log_probs, sigmas, cond.apply(lambda t: t.cpu()), options, uncond
    )
