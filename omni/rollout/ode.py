"""Solvers of the flow-matching probability-flow ODE for the deterministic sampling steps.

`euler` is the first-order step x' = x + (sigma' - sigma) v (`omni.rollout.sde.ode_step`).

`dpm2` is DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of
Diffusion Probabilistic Models", arXiv:2211.01095, Algorithm 2), the higher-order solver
MixGRPO-Flash takes for its ODE steps (Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO
Efficiency with Mixed ODE-SDE", arXiv:2507.21802). On a flow-matching path
x_sigma = alpha x0 + sigma x1 with alpha = 1 - sigma, the model's data prediction and
half log-SNR are

    D      = x - sigma v                       (the clean latent the velocity points to)
    lambda = log(alpha / sigma),   h = lambda' - lambda,   h_prev = lambda - lambda_prev

and the multistep second-order step from sigma to sigma', with the previous step's data
prediction D_prev made at sigma_prev, is

    x' = (sigma' / sigma) x - alpha' (e^-h - 1) ((1 + 1 / (2 r)) D - 1 / (2 r) D_prev),   r = h_prev / h

Its first-order part, (sigma' / sigma) x + alpha' (1 - e^-h) D, is exactly the Euler step
(alpha' (1 - e^-h) = (sigma - sigma') / sigma), so this module computes

    x' = euler(x) + (sigma - sigma') / sigma * h / (2 h_prev) * (D - D_prev)

and a step without the correction is Euler's, bit for bit. The correction is left out
(a first-order step, as DPM-Solver++ does) where the formula has no finite value:
- no previous data prediction: the first ODE step, and the first ODE step after a stochastic
  step (the previous D was made at a latent the SDE step then moved off the ODE's path, so
  each run of consecutive ODE steps is solved as its own ODE from where the SDE left it);
- sigma' = 0: lambda' is infinite; the first-order step lands on D itself (the x0 form);
- sigma_prev = 1: lambda_prev is -infinite, h_prev infinite, and the correction's limit is 0.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from omni.config.rollout import ODESolverType
from omni.rollout.sde import ode_step


def half_log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma, for 0 < sigma < 1."""
    return math.log((1 - sigma) / sigma)


def dpm2_correction(sigma_prev: float, sigma: float, sigma_next: float) -> float:
    """The coefficient c of DPM-Solver++(2M)'s step x' = euler(x) + c (D - D_prev); 0 where
    the step is first order (sigma' = 0 or sigma_prev = 1)."""
    if sigma_next <= 0 or sigma_prev >= 1:
        return 0.0
    h = half_log_snr(sigma_next) - half_log_snr(sigma)
    h_prev = half_log_snr(sigma) - half_log_snr(sigma_prev)
    return (sigma - sigma_next) / sigma * h / (2 * h_prev)


class ODESolver:
    """Takes the ODE steps of one sampling loop, keeping what a multistep solver needs of the
    previous ODE step (its data prediction and noise level). `reset` after a stochastic step."""

    def __init__(self, solver: str):
        self.solver = ODESolverType(solver)  # a ValueError names an unknown solver
        self.previous: Optional[Tuple[torch.Tensor, float]] = None  # (D_prev, sigma_prev)

    def reset(self) -> None:
        self.previous = None

    def step(self, velocity: torch.Tensor, sample: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
        """The ODE step from `sample` at `sigma` to `sigma_next` (scalars), fp32 or wider."""
        x_next = ode_step(velocity, sample, sigma, sigma_next)
        if self.solver == ODESolverType.euler:
            return x_next
        sigma, sigma_next = float(sigma), float(sigma_next)
        data = sample.to(x_next.dtype) - sigma * velocity.to(x_next.dtype)  # D = x - sigma v
        if self.previous is not None:
            data_prev, sigma_prev = self.previous
            coefficient = dpm2_correction(sigma_prev, sigma, sigma_next)
            if coefficient != 0.0:
                x_next = x_next + coefficient * (data - data_prev)
        self.previous = (data, sigma)
        return x_next
