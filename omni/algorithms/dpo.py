"""Diffusion-DPO for flow-matching models (SD3) as pure tensor functions.

What the algorithm does, in plain words: we have pairs of images for the same prompt, one
preferred ("chosen") and one not ("rejected"). Both images are noised to the *same* random
noise level with the *same* noise, and both the trained model (the policy) and a frozen copy
of the starting model (the reference) predict the denoising target for each. The error of a
prediction stands in for how unlikely the model finds the image: a lower error means a more
likely image. The loss rewards the policy for lowering its error on the chosen image, relative
to the reference, by more than it lowers it on the rejected one. Measuring everything relative
to the reference keeps the policy from drifting far from it (beta sets how strongly).

This is Diffusion-DPO (Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference
Optimization", eq. 14) with SD3's rectified-flow parametrisation: the noised latent is
x_t = (1 - sigma) x0 + sigma noise and the transformer predicts the velocity noise - x0, so the
per-sample errors are mean squared velocity errors (the noise-prediction error of the paper,
up to a per-sigma factor folded into beta).

With per-sample errors pc, pr (policy on chosen / rejected) and rc, rr (reference):

    logit = -beta / 2 * ((pc - rc) - (pr - rr))
    loss  = mean over pairs of -log sigmoid(logit)

`logit` equals r(chosen) - r(rejected) for the implicit reward r(x) = -beta / 2 * (policy
error on x - reference error on x) (beta times the policy/reference log-likelihood ratio under
the paper's Gaussian bound). When policy == reference every logit is 0 and the loss is log 2.
The -beta/2 scaling matches the Diffusion-DPO authors' training script, so their beta values
(e.g. 2500 to 5000) carry over.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F

SIGMA_MODES = ("logit_normal", "uniform")
SIGMA_EPS = 1e-5  # keeps sigmas strictly inside (0, 1): sigma = 0 or 1 is a degenerate noise level


def sample_sigmas(
    n: int,
    mode: str = "logit_normal",
    generator: Optional[torch.Generator] = None,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """`n` training noise levels in (0, 1), float32 on the CPU.

    "logit_normal": sigmoid(N(logit_mean, logit_std^2)), SD3's training distribution, which
    favours middle noise levels. "uniform": U(0, 1). Both are clamped to [1e-5, 1 - 1e-5]."""
    if mode == "logit_normal":
        normal = torch.randn(n, generator=generator) * logit_std + logit_mean
        sigmas = torch.sigmoid(normal)
    elif mode == "uniform":
        sigmas = torch.rand(n, generator=generator)
    else:
        raise ValueError(f"unknown sigma sampling mode '{mode}' (expected one of {', '.join(SIGMA_MODES)})")
    return sigmas.clamp(SIGMA_EPS, 1 - SIGMA_EPS)


def _per_sample(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Shape (B,) sigmas as (B, 1, 1, ...) so they broadcast over `like`'s other dims."""
    return sigmas.to(like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Rectified-flow interpolation x_t = (1 - sigma) x0 + sigma noise, one sigma per sample."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} differ in shape")
    if sigmas.shape != (x0.shape[0],):
        raise ValueError(f"expected one sigma per sample ({x0.shape[0]}), got shape {tuple(sigmas.shape)}")
    s = _per_sample(sigmas, x0)
    return (1 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """What SD3's transformer predicts at any sigma: d x_t / d sigma = noise - x0."""
    return noise - x0


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every dimension but the first: shape (B,), computed in float32."""
    squared = (pred.float() - target.float()) ** 2
    return squared.mean(dim=tuple(range(1, squared.ndim)))


def implicit_rewards(policy_err: torch.Tensor, ref_err: torch.Tensor, beta: float) -> torch.Tensor:
    """The implicit reward of each image: -beta/2 * (policy error - reference error).
    Positive when the policy fits the image better than the reference does."""
    return -0.5 * beta * (policy_err - ref_err)


def diffusion_dpo_loss(
    policy_err_chosen: torch.Tensor,
    policy_err_rejected: torch.Tensor,
    ref_err_chosen: torch.Tensor,
    ref_err_rejected: torch.Tensor,
    beta: float,
) -> Dict[str, torch.Tensor]:
    """The Diffusion-DPO loss of a batch of pairs from per-sample errors (each of shape (B,)).

    Returns a dict; only "loss" carries gradients, the rest are detached scalars for logging:
      loss               mean of -log sigmoid(logit), logit = r(chosen) - r(rejected)
      implicit_accuracy  fraction of pairs with logit > 0 (the policy's implicit reward prefers
                         the chosen image; exactly 0 at init, where every logit is 0)
      reward_margin      mean logit, i.e. the mean implicit reward difference r(chosen) - r(rejected)
      reward_chosen, reward_rejected           mean implicit rewards (see `implicit_rewards`)
      policy_err_chosen, policy_err_rejected   mean policy errors
      ref_err_chosen, ref_err_rejected         mean reference errors
    """
    errors = (policy_err_chosen, policy_err_rejected, ref_err_chosen, ref_err_rejected)
    if len({tuple(e.shape) for e in errors}) != 1 or policy_err_chosen.ndim != 1:
        raise ValueError(f"expected four errors of the same shape (B,), got {[tuple(e.shape) for e in errors]}")
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    ref_err_chosen, ref_err_rejected = ref_err_chosen.detach(), ref_err_rejected.detach()
    reward_chosen = implicit_rewards(policy_err_chosen, ref_err_chosen, beta)
    reward_rejected = implicit_rewards(policy_err_rejected, ref_err_rejected, beta)
    logits = reward_chosen - reward_rejected
    loss = -F.logsigmoid(logits).mean()
    metrics = {
        "implicit_accuracy": (logits > 0).float().mean(),
        "reward_margin": logits.mean(),
        "reward_chosen": reward_chosen.mean(),
        "reward_rejected": reward_rejected.mean(),
        "policy_err_chosen": policy_err_chosen.mean(),
        "policy_err_rejected": policy_err_rejected.mean(),
        "ref_err_chosen": ref_err_chosen.mean(),
        "ref_err_rejected": ref_err_rejected.mean(),
    }
    return {"loss": loss, **{name: value.detach() for name, value in metrics.items()}}
