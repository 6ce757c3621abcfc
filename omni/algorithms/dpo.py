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

import glob
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

from omni import seeding
from omni.algorithms.base import Algorithm, sync_engine
from omni.algorithms.dpo_pairs import EVAL_CHUNK, PairBatch, PairData, split_digest
from omni.config.algorithm import AlgorithmConfig, SigmaSampling
from omni.config.errors import require
from omni.context import update_seed

logger = logging.getLogger(__name__)

SIGMA_MODES = tuple(mode.value for mode in SigmaSampling)
SIGMA_EPS = 1e-5  # keeps sigmas strictly inside (0, 1): sigma = 0 or 1 is a degenerate noise level
REFERENCE_CHUNK = EVAL_CHUNK  # pairs the reference scores in one forward (no gradients, as in evaluation)


@dataclass
class DPOConfig(AlgorithmConfig):
    # Strength of the pull towards the reference (Diffusion-DPO's beta).
    beta: float = 2500.0
    # How training noise levels are drawn.
    sigma_sampling: SigmaSampling = SigmaSampling.logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0


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
def _noised(worker, pairs: PairBatch, sigmas: torch.Tensor, noise: torch.Tensor):
    """The transformer's inputs and target for the chosen rows then the rejected rows of
    `pairs` (each pair's two images share noise level and noise), on the device."""
    x0 = worker.to_device(torch.cat([pairs.x0_chosen, pairs.x0_rejected]))
    noise2, sigmas2 = worker.to_device(torch.cat([noise, noise])), torch.cat([sigmas, sigmas])
    cond2 = pairs.cond.apply(lambda t: worker.to_device(torch.cat([t, t])))
    return noisy_latents(x0, noise2, sigmas2.to(x0.device)), sigmas2, cond2, velocity_target(x0, noise2)


def reference_errors(worker, pairs: PairBatch, sigmas: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The reference's errors, shape (2 * len(pairs),): chosen rows then rejected rows. Without
    gradients, so in forwards of REFERENCE_CHUNK pairs (an evaluation's chunk), not of the
    policy's micro-batches: one switch to the reference per update, and fewer, fuller forwards."""
    parts = []
    for rows in torch.arange(len(pairs)).split(REFERENCE_CHUNK):
        noisy, sigmas2, cond2, target = _noised(worker, pairs.select(rows), sigmas[rows], noise[rows])
        parts.append(per_sample_mse(worker.velocity(noisy, sigmas2, cond2, 1.0, reference=True), target).view(2, -1))
    return torch.cat(parts, dim=1).flatten()


def pair_outputs(
    worker, pairs: PairBatch, sigmas: torch.Tensor, noise: torch.Tensor, ref_err: Optional[torch.Tensor] = None
) -> Dict[str, torch.Tensor]:
    """Diffusion-DPO loss and metrics for pairs sharing noise level and noise. `ref_err`: the
    reference's errors on these inputs (`reference_errors`), when already known."""
    n = len(pairs)
    noisy, sigmas2, cond2, target = _noised(worker, pairs, sigmas, noise)
    policy_err = per_sample_mse(worker.velocity(noisy, sigmas2, cond2, 1.0), target)
    if ref_err is None:
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
    ref_err = reference_errors(worker, pairs, sigmas, noise)  # chosen rows, then rejected rows
    worker.zero_grad()
    sums: Dict[str, torch.Tensor] = {}  # summed on the device: no sync per micro-batch
    chunks = torch.arange(n).split(max(1, worker.cfg.trainer.micro_batch_size // 2))
    for i, rows in enumerate(chunks):
        out = pair_outputs(
            worker, pairs.select(rows), sigmas[rows], noise[rows], torch.cat([ref_err[rows], ref_err[n + rows]])
        )
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
def mean_over_chunks(parts) -> Dict[str, float]:
    """Metrics of several chunks of pairs, each weighted by its number of pairs."""
    total = sum(n for n, _ in parts)
    return {key: sum(n * metrics[key] for n, metrics in parts) / total for key in parts[0][1]}


class OfflineDPO(Algorithm):
    Options = DPOConfig  # its options: schema/algorithm/dpo

    @classmethod
    def uses_reference(cls, cfg) -> bool:
        return True  # every logit compares the policy's error with the reference's

    @classmethod
    def check_config(cls, cfg) -> None:
        check_dpo(cfg.algorithm)
        data = cfg.data
        require(
            data.pairs is not None,
            "algorithm=dpo learns from preference pairs: choose data=pairs and set data.pairs=/path/to/pairs.jsonl "
            "(python scripts/make_preference_pairs.py DIR writes a small synthetic set)",
        )
        pairs = data.pairs
        require(
            glob.has_magic(pairs) or Path(pairs).expanduser().exists(), f"data.pairs={pairs}: no such file or directory"
        )
        cache = data.latent_cache
        require(
            not cache or cache == "auto" or not Path(cache).expanduser().is_file(),
            f"data.latent_cache={cache}: a file, expected a directory",
        )
        fraction = data.pairs_eval_fraction
        require(0 <= fraction < 1, f"data.pairs_eval_fraction={fraction}: expected a share in [0, 1)")
        cap = data.pairs_eval_max
        require(
            cap is None or cap > 0,
            f"data.pairs_eval_max={cap}: expected a positive number of held-out pairs (null: all)",
        )
        require(
            data.num_workers >= 0, f"data.num_workers={data.num_workers}: expected 0 (decode in the driver) or more"
        )

    def __init__(self, ctx):
        """Reads and checks the pairs, or the latent cache's manifest (before any model loads)."""
        super().__init__(ctx)
        self.data = PairData(self.cfg)
        steps = self.cfg.model.vae_inversion_steps
        if steps and self.data.cache_dir is None:
            logger.warning(
                "model.vae_inversion_steps=%d with data.latent_cache=null: each pair's images are encoded by "
                "%d decoder passes every time the pair is used; data.latent_cache=auto (the default) encodes them once",
                steps,
                steps,
            )
        self.consumed = 0  # the data position: training pairs taken so far
        self.batches = None  # the provider's iterator, opened at the first step

    def setup(self) -> None:
        """Opens the pairs' provider (building the latent cache first if it is missing)."""
        self.provider = self.data.provider(self.ctx.worker, self.ctx.sampling_options(), self.cfg.trainer.progress_bar)

    @property
    def data_stats(self) -> Dict[str, float]:
        stats = {f"data/{k}": float(v) for k, v in self.data.stats.items()}
        stats["data/skipped_bad"] += self.provider.dropped
        return stats

    def step(self, step: int) -> Dict[str, float]:
        cfg, worker = self.cfg, self.ctx.worker
        tick = time.perf_counter()
        if self.batches is None:
            self.batches = self.provider.train_batches(self.consumed)
        pairs = next(self.batches)
        self.consumed += cfg.trainer.batch_size
        if pairs is None:
            raise ValueError(f"no pair of training step {step + 1} could be decoded (data.pairs={cfg.data.pairs})")
        data_s, tick = time.perf_counter() - tick, time.perf_counter()
        metrics = worker.apply_update(update, pairs, update_seed(cfg.seed, step))
        timings = {
            "time/data": data_s,
            "time/update": time.perf_counter() - tick,
            **sync_engine(worker),
        }
        return {**{f"train/{k}": v for k, v in metrics.items()}, **timings, **self.data_stats}

    def evaluate(self) -> Dict[str, float]:
        if not len(self.data.held_out):
            return {}
        parts = []
        n_chunks = -(-len(self.data.held_out) // EVAL_CHUNK)
        batches = tqdm(
            self.provider.eval_batches(),
            desc="eval pairs",
            total=n_chunks,
            unit="chunk",
            leave=False,
            disable=not self.cfg.trainer.progress_bar or n_chunks < 2,
        )
        for chunk, pairs in enumerate(batches):
            if pairs is not None:  # the first chunk draws the noise a single batch did
                seed = seeding.derive_seed(chunk, self.cfg.eval.seed, seeding.EVAL_CHUNK)
                parts.append((len(pairs), self.ctx.worker.evaluate_batch(evaluate, pairs, seed)))
        if not parts:  # every held-out pair was unreadable (and skipped)
            return {}
        metrics = mean_over_chunks(parts)
        return {f"eval/{k}": v for k, v in metrics.items() if k in ("loss", "implicit_accuracy", "reward_margin")}

    def state_dict(self) -> Dict[str, object]:
        return {
            "pairs_consumed": self.consumed,
            "train_pairs": len(self.data.train),
            "split": split_digest(self.data.train),
        }

    def load_state_dict(self, state: Dict[str, object], step: int) -> None:
        """Continue after the pairs the checkpoint had consumed, on the same split of the same data."""
        if not state:  # a checkpoint from before the data position was saved: constant batches
            self.consumed = step * self.cfg.trainer.batch_size
            return
        here = {"train_pairs": len(self.data.train), "split": split_digest(self.data.train)}
        if {k: state.get(k) for k in here} != here:
            raise ValueError(
                f"trainer.resume: the checkpoint trained on {state.get('train_pairs')} pairs "
                f"(split {state.get('split')}), "
                f"this run's data.pairs={self.cfg.data.pairs} gives {here['train_pairs']} (split {here['split']}): "
                "resume with the same data, data.skip_bad_rows, data.pairs_eval_fraction and seed"
            )
        self.consumed, self.batches = int(state["pairs_consumed"]), None

    def close(self) -> None:
        self.batches = None  # stops the DataLoader's workers


def check_dpo(algo) -> None:
    require(algo.beta > 0, f"algorithm.beta={algo.beta} must be positive")
    require(algo.logit_std > 0, f"algorithm.logit_std={algo.logit_std} must be positive")


ALGORITHM = OfflineDPO
