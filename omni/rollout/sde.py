"""Flow-matching sampling steps with log-probabilities (Flow-GRPO's ODE-to-SDE conversion).

A rectified-flow model predicts a velocity v at noise level sigma. The deterministic (ODE)
Euler step is x' = x + (sigma' - sigma) v. Flow-GRPO replaces it by an SDE with the same
marginals whose step is Gaussian:

    std_t  = noise_level * sqrt(sigma / (1 - sigma))
    mean   = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    x'     = mean + std_t sqrt(-dt) * eps,       dt = sigma' - sigma < 0

so the log-probability of the step taken is a Gaussian log-density; it is averaged over
the latent's elements, as in the paper.

Coefficients-Preserving Sampling (`sde_type="cps"`; Wang and Yu 2025, "Coefficients-
Preserving Sampling for Reinforcement Learning with Flow Matching", arXiv:2509.05952) keeps
the coefficients of DDIM: from the model's estimates of the clean latent x0 = x - sigma v and
of the noise x1 = x + (1 - sigma) v, the step to sigma' is

    std    = sigma' sin(eta pi / 2)                       (eta = noise_level, in (0, 1])
    mean   = (1 - sigma') x0 + sqrt(sigma'^2 - std^2) x1  = (1 - sigma') x0 + sigma' cos(eta pi / 2) x1
    x'     = mean + std * eps

so x' is (1 - sigma') x0 plus noise of total std sigma', exactly the marginal's
coefficients: the SDE step instead inflates the noise at low sigma, and its samples stay
noisy. The step that lands on sigma' = 0 has no noise (it is the ODE's Euler step): it
carries no log-probability and no sampler treats it as stochastic (`noisy_steps`). Both
the rollout engine and the actor call these functions, so the log-probs they compute
agree by construction.

The step and its log-prob are computed in at least fp32 whatever the transformer's dtype:
in bf16 a log-prob is off by about 1e-3, ten times the ratio's clip range.
"""

from __future__ import annotations

import math

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def sde_std(sigma: torch.Tensor, sigma_max: float, noise_level: float) -> torch.Tensor:
    """The SDE's diffusion scale at `sigma`; sigma = 1 would divide by zero, so the
    schedule's largest sigma below 1 stands in for it there."""
    denom = 1 - torch.where(sigma >= 1, torch.as_tensor(sigma_max, dtype=sigma.dtype), sigma)
    return noise_level * torch.sqrt(sigma / denom)


def sde_mean_and_scale(velocity, sample, sigma, sigma_next, sigma_max, noise_level):
    """Mean and standard deviation of the Gaussian SDE step from `sample` at `sigma`."""
    velocity, sample = _at_least_fp32(velocity), _at_least_fp32(sample)
    sigma = _per_sample(sigma, sample)
    sigma_next = _per_sample(sigma_next, sample)
    dt = sigma_next - sigma
    std_t = sde_std(sigma, sigma_max, noise_level)
    mean = sample * (1 + std_t**2 / (2 * sigma) * dt) + velocity * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_t * torch.sqrt(-dt)


def cps_mean_and_scale(velocity, sample, sigma, sigma_next, noise_level):
    """Mean and standard deviation of the coefficients-preserving step from `sample` at `sigma`."""
    velocity, sample = _at_least_fp32(velocity), _at_least_fp32(sample)
    sigma = _per_sample(sigma, sample)
    sigma_next = _per_sample(sigma_next, sample)
    clean = sample - sigma * velocity
    noise = sample + (1 - sigma) * velocity
    angle = noise_level * math.pi / 2
    mean = (1 - sigma_next) * clean + sigma_next * math.cos(angle) * noise
    return mean, sigma_next * math.sin(angle)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-sample log-density of x under N(mean, scale^2), averaged over the latent."""
    log_p = -((x.detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - _LOG_SQRT_2PI
    return log_p.mean(dim=tuple(range(1, x.ndim)))


def sde_step(velocity, sample, sigma, sigma_next, sigma_max, noise_level, noise=None, next_sample=None, sde_type="sde"):
    """One stochastic step ("sde" or "cps"). Draws x' = mean + scale * noise unless
    `next_sample` is given (the actor re-scoring a stored trajectory). Returns
    (x', log_prob, mean, scale)."""
    if sde_type == "sde":
        mean, scale = sde_mean_and_scale(velocity, sample, sigma, sigma_next, sigma_max, noise_level)
    elif sde_type == "cps":
        if bool((torch.as_tensor(sigma_next) <= 0).any()):
            raise ValueError(
                "a coefficients-preserving step to sigma 0 has no noise and no log-probability; it is an ODE step"
            )
        mean, scale = cps_mean_and_scale(velocity, sample, sigma, sigma_next, noise_level)
    else:
        raise ValueError(f"sde_type {sde_type!r}: expected sde or cps")
    if next_sample is None:
        next_sample = mean + scale * _at_least_fp32(noise)
    next_sample = _at_least_fp32(next_sample)
    return next_sample, gaussian_log_prob(next_sample, mean, scale), mean, scale


def ode_step(velocity, sample, sigma, sigma_next):
    """The deterministic Euler step of the probability-flow ODE."""
    velocity, sample = _at_least_fp32(velocity), _at_least_fp32(sample)
    return sample + (_per_sample(sigma_next, sample) - _per_sample(sigma, sample)) * velocity


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    return value.reshape(-1, *([1] * (like.ndim - 1))) if value.ndim else value


def is_noisy_step(sde_type: str, sigma_next) -> bool:
    """Whether a stochastic step to `sigma_next` draws noise (CPS's step to sigma 0 does not)."""
    return sde_type != "cps" or float(sigma_next) > 0


def noisy_steps(rollout) -> int:
    """How many of the rollout's steps may be stochastic (from the first): all for "sde"; for
    "cps" all but the last, which lands on sigma 0 (every flow-matching schedule ends there)."""
    return rollout.num_steps - (1 if rollout.sde_type == "cps" else 0)


def sde_window(num_steps: int, window_size: int, window_range, generator: torch.Generator) -> tuple[int, int]:
    """Steps [start, stop) sampled with the SDE. window_size 0: all steps (plain Flow-GRPO);
    otherwise a window of `window_size` steps whose start is drawn from `window_range`."""
    if window_size <= 0:
        return 0, num_steps
    lo, hi = window_range if window_range is not None else (0, num_steps - window_size)
    start = int(torch.randint(lo, hi + 1, (1,), generator=generator))
    return start, start + window_size
