"""Offline Diffusion-DPO for flow-matching models: the loss as tensor functions, the update
on a worker, and the training step over a preference-pair file.

    python scripts/make_preference_pairs.py /tmp/pairs
    python recipes/train.py algorithm=dpo data=pairs data.pairs=/tmp/pairs/pairs.jsonl

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

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from omni.algorithms.base import Algorithm
from omni.config.algorithm import SigmaSampling
from omni.config.errors import require
from omni.context import update_seed
from omni.data.preferences import PreferencePair, images_to_tensor, load_preference_pairs
from omni.data.prompts import items_for_step
from omni.models.base import Conditioning

SIGMA_MODES = tuple(mode.value for mode in SigmaSampling)
ENCODE_CHUNK = 32
SIGMA_EPS = 1e-5  # keeps sigmas strictly inside (0, 1): sigma = 0 or 1 is a degenerate noise level


def sample_sigmas(
    n: int,
    mode: str = SigmaSampling.logit_normal,
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


# ----------------------------------------------------------------- the update, on a worker
@dataclass
class PairBatch:
    """Latents of chosen and rejected images and their prompts' conditioning, row-aligned."""

    x0_chosen: torch.Tensor
    x0_rejected: torch.Tensor
    cond: Conditioning

    def __len__(self) -> int:
        return len(self.x0_chosen)

    def select(self, rows) -> "PairBatch":
        return PairBatch(self.x0_chosen[rows].clone(), self.x0_rejected[rows].clone(), self.cond.apply(lambda t: t[rows].clone()))


def pair_outputs(worker, pairs: PairBatch, sigmas: torch.Tensor, noise: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Diffusion-DPO loss and metrics for pairs sharing noise level and noise."""
    n = len(pairs)
    x0 = worker.to_device(torch.cat([pairs.x0_chosen, pairs.x0_rejected]))
    noise2, sigmas2 = worker.to_device(torch.cat([noise, noise])), torch.cat([sigmas, sigmas])
    cond2 = pairs.cond.apply(lambda t: worker.to_device(torch.cat([t, t])))
    noisy, target = noisy_latents(x0, noise2, sigmas2.to(x0.device)), velocity_target(x0, noise2)
    policy_err = per_sample_mse(worker.velocity(noisy, sigmas2, cond2, 1.0), target)
    ref_err = per_sample_mse(worker.velocity(noisy, sigmas2, cond2, 1.0, reference=True), target)
    return diffusion_dpo_loss(policy_err[:n], policy_err[n:], ref_err[:n], ref_err[n:], worker.cfg.algorithm.beta)


def pair_noise(algo, shape: torch.Size, seed: int):
    """Noise levels and noise of `shape[0]` pairs of latents of `shape[1:]`."""
    generator = torch.Generator().manual_seed(seed)
    sigmas = sample_sigmas(shape[0], algo.sigma_sampling, generator, algo.logit_mean, algo.logit_std)
    return sigmas, torch.randn(shape, generator=generator)


def update(worker, pairs: PairBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """One optimizer step of Diffusion-DPO over the pairs, in micro-batches of pairs. A worker
    of a group holds pairs [first, first + n) of `total`: it draws the whole batch's noise and
    keeps its rows, so the split does not change the noise."""
    n = len(pairs)
    sigmas, noise = pair_noise(worker.cfg.algorithm, (total or n, *pairs.x0_chosen.shape[1:]), seed)
    sigmas, noise = sigmas[first : first + n], noise[first : first + n]
    worker.zero_grad()
    sums: Dict[str, torch.Tensor] = {}  # summed on the device: no sync per micro-batch
    chunks = torch.arange(n).split(max(1, worker.cfg.trainer.micro_batch_size // 2))
    for i, rows in enumerate(chunks):
        out = pair_outputs(worker, pairs.select(rows), sigmas[rows], noise[rows])
        worker.backward(out["loss"] * len(rows) / n, sync=i == len(chunks) - 1)
        for key, value in out.items():
            sums[key] = sums.get(key, 0.0) + value.detach().double() * len(rows) / n
    metrics = {key: float(value) for key, value in sums.items()}
    metrics["grad_norm"] = worker.optimizer_step()
    metrics["skipped_nonfinite"] = float(not math.isfinite(metrics["grad_norm"]))
    return metrics


def evaluate(worker, pairs: PairBatch, seed: int) -> Dict[str, float]:
    """Loss, implicit accuracy and margin on held-out pairs (fixed noise levels and noise)."""
    sigmas, noise = pair_noise(worker.cfg.algorithm, pairs.x0_chosen.shape, seed)
    return {k: float(v) for k, v in pair_outputs(worker, pairs, sigmas, noise).items()}


# ----------------------------------------------------------------- the step, on the driver
def split_pairs(pairs: List[PreferencePair], eval_fraction: float, seed: int):
    """A seeded split into (train, held-out) pairs; at least one pair on each side."""
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(max(1, round(len(pairs) * eval_fraction)), len(pairs) - 1) if eval_fraction > 0 else 0
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


def encode_pairs(pairs: List[PreferencePair], worker, options, progress: bool) -> PairBatch:
    """Latents of the chosen and rejected images and the prompts' conditioning, on the CPU."""
    chosen, rejected, conds = [], [], []
    chunks = range(0, len(pairs), ENCODE_CHUNK)
    for start in tqdm(chunks, desc="encoding pairs", disable=not progress or len(chunks) < 2):
        chunk = pairs[start : start + ENCODE_CHUNK]
        chosen.append(worker.encode_images(images_to_tensor([p.chosen for p in chunk], options.resolution)))
        rejected.append(worker.encode_images(images_to_tensor([p.rejected for p in chunk], options.resolution)))
        conds.append(worker.encode_prompts([p.prompt for p in chunk], 1.0, options.max_sequence_length))
    return PairBatch(torch.cat(chosen), torch.cat(rejected), type(conds[0]).cat(conds))


class OfflineDPO(Algorithm):
    @classmethod
    def check_config(cls, cfg) -> None:
        check_dpo(cfg.algorithm)
        pairs = cfg.data.pairs
        require(
            pairs is not None,
            "algorithm=dpo learns from preference pairs: choose data=pairs and set data.pairs=/path/to/pairs.jsonl "
            "(python scripts/make_preference_pairs.py DIR writes a small synthetic set)",
        )
        require(Path(pairs).expanduser().exists(), f"data.pairs={pairs}: no such file or directory")
        fraction = cfg.data.pairs_eval_fraction
        require(0 <= fraction < 1, f"data.pairs_eval_fraction={fraction}: expected a share in [0, 1)")

    def __init__(self, ctx):
        """Reads and checks the pairs (before any model loads)."""
        super().__init__(ctx)
        data = self.cfg.data
        pairs, stats = load_preference_pairs(data.pairs, "data.pairs", skip_bad_rows=data.skip_bad_rows)
        self.data_stats = {f"data/{k}": float(v) for k, v in stats.items()}
        self.split = split_pairs(pairs, data.pairs_eval_fraction, self.cfg.seed)

    def setup(self) -> None:
        """Encodes the pairs once with the worker's VAE and text encoders."""
        train, held_out = self.split
        worker, options, progress = self.ctx.worker, self.ctx.sampling_options(), self.cfg.trainer.progress_bar
        self.train_pairs = encode_pairs(train, worker, options, progress)
        self.eval_pairs = encode_pairs(held_out, worker, options, progress) if held_out else None

    def step(self, step: int) -> Dict[str, float]:
        cfg, worker = self.cfg, self.ctx.worker
        tick = time.perf_counter()
        index = torch.tensor(items_for_step(list(range(len(self.train_pairs))), step, cfg.trainer.batch_size, cfg.seed))
        metrics = worker.train(update, self.train_pairs.select(index), update_seed(cfg.seed, step))
        timings = {"time/update": time.perf_counter() - tick, "time/sync": worker.sync_weights()["sync/seconds"]}
        return {**{f"train/{k}": v for k, v in metrics.items()}, **timings, **self.data_stats}

    def evaluate(self) -> Dict[str, float]:
        if self.eval_pairs is None:
            return {}
        metrics = self.ctx.worker.evaluate(evaluate, self.eval_pairs, self.cfg.trainer.eval_seed)
        return {f"eval/{k}": v for k, v in metrics.items() if k in ("loss", "implicit_accuracy", "reward_margin")}


def check_dpo(algo) -> None:
    require(algo.beta > 0, f"algorithm.beta={algo.beta} must be positive")
    require(algo.logit_std > 0, f"algorithm.logit_std={algo.logit_std} must be positive")


ALGORITHM = OfflineDPO
