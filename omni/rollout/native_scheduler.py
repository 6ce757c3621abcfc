"""Flow-GRPO's SDE step as a diffusers scheduler, for pipelines whose denoising loop is not ours.

`rollout.options.backend=native` runs vLLM-Omni's own pipeline for the family (its
transformer, attention kernels and text encoders). Its denoising loop, like diffusers',
asks a scheduler for each step: `scheduler.step(velocity, t, latents, return_dict=False)`.
`FlowGRPOScheduler` is that scheduler. Between `start_rollout` and `finish_rollout` it takes
the steps `omni.rollout.sampling.sample_trajectories` takes, with the same function
(`rollout_step`: the SDE step with its log-prob inside the window, the ODE solver elsewhere),
and records the trajectory, so the actor re-scores what was sampled; outside a rollout
(vLLM-Omni's start-up warm-up) it is the plain flow-matching Euler scheduler it extends.

Like our sampler it keeps the latents in fp32: the loop gets them back in its own dtype
(bf16 on a GPU) for the next transformer call, but the step continues from its fp32 copy.
Image i's noise comes from a generator seeded with seeds[i] that has first drawn the
initial latent (as the sampler's does), in the family's own layout (its `native.noise`:
a packed family draws its noise unpacked and packs it, as its initial latent), so in fp32
the images equal the in-process engine's for the same weights and seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni.models.native import unpacked_step_noise
from omni.rollout.base import SamplingOptions
from omni.rollout.ode import ODESolver
from omni.rollout.sampling import rollout_step

Noise = Callable[[Sequence[torch.Generator], torch.Tensor], torch.Tensor]  # a family's `native.noise`


@dataclass
class Trajectory:
    latents: torch.Tensor  # (B, T + 1, *latent) fp32 on the CPU: x_T ... x_0
    log_probs: torch.Tensor  # (B, T) fp32; 0 on ODE steps
    sigmas: torch.Tensor  # (T + 1,) fp32


class _Rollout:
    """One batch's state between start_rollout and finish_rollout."""

    def __init__(self, seeds: Sequence[int], options: SamplingOptions, noise: Noise):
        self.options = options
        self.noise = noise
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.index = 0
        self.x: Optional[torch.Tensor] = None
        self.trajectory: List[torch.Tensor] = []
        self.log_probs: List[torch.Tensor] = []
        self.ode = ODESolver(options.ode_solver)

    def draw(self, like: torch.Tensor) -> torch.Tensor:
        """One latent of standard normal noise per image, from its own generator."""
        return self.noise(self.generators, like).to(like.device)


class FlowGRPOScheduler(FlowMatchEulerDiscreteScheduler):
    """Build it from the pipeline's scheduler: `FlowGRPOScheduler.from_config(pipe.scheduler.config)`."""

    _rollout: Optional[_Rollout] = None

    def start_rollout(self, seeds: Sequence[int], options: SamplingOptions, noise: Noise = unpacked_step_noise) -> None:
        """The next denoising loop samples `seeds` (one per latent of its batch) with `options`,
        drawing its noise with `noise(generators, like)`."""
        self._rollout = _Rollout(seeds, options, noise)

    def finish_rollout(self) -> Trajectory:
        run, self._rollout = self._rollout, None
        if run is None or run.index != run.options.num_steps:
            done = 0 if run is None else run.index
            raise RuntimeError(
                f"the pipeline took {done} scheduler steps; the rollout asked for "
                f"{run.options.num_steps if run else '?'}"
            )
        return Trajectory(
            torch.stack(run.trajectory, 1).cpu(), torch.stack(run.log_probs, 1).cpu(), self.sigmas.float().cpu().clone()
        )

    def cancel_rollout(self) -> None:
        """Drop an unfinished rollout (its forward failed): later steps are plain Euler again."""
        self._rollout = None

    @property
    def in_rollout(self) -> bool:
        return self._rollout is not None

    def rollout_sigmas(self, batch: int, device) -> Optional[torch.Tensor]:
        """The fp32 noise level of the coming transformer call, one per latent, as the actor
        computes it; None outside a rollout or past its last step."""
        run = self._rollout
        if run is None or run.index >= len(self.sigmas) - 1:
            return None
        return self.sigmas[run.index].float().expand(batch).to(device)

    def final_latents(self) -> torch.Tensor:
        """x_0 in fp32, before finish_rollout (to decode)."""
        return self._rollout.x

    def step(self, model_output, timestep, sample, *args, return_dict: bool = True, **kwargs):
        run = self._rollout
        if run is None:
            return super().step(model_output, timestep, sample, *args, return_dict=return_dict, **kwargs)
        options = run.options
        i = run.index
        if i >= options.num_steps:
            raise RuntimeError(f"scheduler step {i + 1} of a {options.num_steps}-step rollout")
        if i == 0:
            run.x = sample.float()
            run.draw(run.x)  # the initial latent's draw: the step noise comes after it
            run.trajectory.append(run.x)
        sigmas = self.sigmas.float().cpu()
        velocity = model_output.float()
        run.x, log_prob = rollout_step(velocity, run.x, sigmas, i, options, run.ode, lambda: run.draw(run.x))
        run.trajectory.append(run.x)
        run.log_probs.append(log_prob)
        run.index += 1
        out = run.x.to(sample.dtype)
        return (out,) if not return_dict else _StepOutput(out)


@dataclass
class _StepOutput:
    prev_sample: torch.Tensor
