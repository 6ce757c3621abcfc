"""DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward
Process", arXiv:2509.16117): reinforcement on the forward (noising) process, so the rollouts
may use any sampler (here the deterministic ODE), need no log-probabilities and no CFG.

Each prompt's `group_size` images get group advantages A (as Flow-GRPO's), mapped to an
optimality probability r = clamp(A / adv_clip_max / 2 + 1/2, 0, 1). Each clean latent x0 is
noised, x_t = (1 - t) x0 + t eps, and the velocity v of the policy being trained is mixed with
v_old, the rollout policy's (computed before the first optimizer step), into two implicit
policies:

    v+ = (1 - beta) v_old + beta v        (the positive policy: trained towards x0 where r is high)
    v- = (1 + beta) v_old - beta v        (the negative policy: trained towards x0 where r is low)

Each predicts the clean latent x0_hat = x_t - t v; its squared error is divided by its own
mean absolute error (a constant: the paper's adaptive weighting), and

    loss = mean over samples of adv_clip_max / beta * (r ||x0_hat+ - x0||^2 + (1 - r) ||x0_hat- - x0||^2)

Minimising it moves v along the direction that separates good images from bad ones, with
v_old as the anchor: at r = 1/2 the two terms cancel to first order.

    python recipes/train.py algorithm=diffusion_nft
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from omni import seeding
from omni.algorithms.advantages import clip_advantages
from omni.algorithms.base import Algorithm, grouped_rollout, sync_engine
from omni.algorithms.dpo import noisy_latents, sample_sigmas
from omni.algorithms.flow_grpo import check_groups
from omni.config.algorithm import GroupAdvantageConfig, SigmaSampling
from omni.config.errors import require
from omni.config.rollout import SDEType
from omni.context import update_seed
from omni.models import get_family
from omni.models.base import Conditioning


def optimality(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """Advantages -> the probability r in [0, 1] that an image is a good one."""
    return (advantages / adv_clip_max / 2 + 0.5).clamp(0, 1)


def implicit_policies(
    velocity: torch.Tensor, old_velocity: torch.Tensor, beta: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(v+, v-) = ((1 - beta) v_old + beta v, (1 + beta) v_old - beta v)."""
    return (1 - beta) * old_velocity + beta * velocity, (1 + beta) * old_velocity - beta * velocity


def normalised_x0_error(
    velocity: torch.Tensor, noisy: torch.Tensor, sigmas: torch.Tensor, clean: torch.Tensor
) -> torch.Tensor:
    """Per sample: mean of (x0_hat - x0)^2 / mean|x0_hat - x0| with x0_hat = x_t - t v; the
    divisor is a constant (no gradient), at least 1e-5."""
    t = sigmas.reshape(-1, *([1] * (noisy.ndim - 1)))
    error = noisy - t * velocity - clean
    dims = tuple(range(1, error.ndim))
    scale = error.detach().abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    return (error**2 / scale).mean(dim=dims)


def nft_loss(velocity, old_velocity, noisy, sigmas, clean, r, beta: float, adv_clip_max: float):
    """DiffusionNFT's loss, averaged over samples -> (loss, positive error, negative error)."""
    positive, negative = implicit_policies(velocity, old_velocity.detach(), beta)
    pos_err = normalised_x0_error(positive, noisy, sigmas, clean)
    neg_err = normalised_x0_error(negative, noisy, sigmas, clean)
    loss = (adv_clip_max / beta * (r * pos_err + (1 - r) * neg_err)).mean()
    return loss, pos_err.mean(), neg_err.mean()


# ----------------------------------------------------------------- the update, on a worker
@dataclass
class DiffusionNFTConfig(GroupAdvantageConfig):
    """DiffusionNFT: forward-process training on ODE rollouts (the clipped advantages are
    mapped to optimality in [0, 1])."""

    # How far the implicit policies reach from the rollout policy.
    beta: float = 1.0
    # Noise levels drawn per clean latent, and how.
    timesteps_per_sample: int = 2
    sigma_sampling: SigmaSampling = SigmaSampling.uniform
    num_inner_epochs: int = 1
    num_minibatches: int = 2


@dataclass
class NFTBatch:
    """Clean latents of the rollouts, their conditioning and optimality probabilities."""

    clean: torch.Tensor  # (B, *latent)
    cond: Conditioning
    optimality: torch.Tensor  # (B,)
    guidance_scale: float

    def __len__(self) -> int:
        return len(self.clean)

    def select(self, rows) -> "NFTBatch":
        cond = self.cond.apply(lambda t: t[rows].clone())
        return NFTBatch(self.clean[rows].clone(), cond, self.optimality[rows].clone(), self.guidance_scale)


def forward_noise(algo, n_total: int, shape, seed: int, first: int, n: int):
    """Each sample's `timesteps_per_sample` noise levels and noises, drawn for the whole batch
    and cut to rows [first, first + n), so sharding does not change them:
    (sigmas (n, K), noise (n, K, *latent))."""
    generator = torch.Generator().manual_seed(seed)
    k = algo.timesteps_per_sample
    sigmas = sample_sigmas(n_total * k, algo.sigma_sampling, generator).reshape(n_total, k)
    noise = torch.randn((n_total, k, *shape), generator=generator)
    return sigmas[first : first + n], noise[first : first + n]


@dataclass
class NoisedBatch:
    """Each clean latent noised at its `timesteps_per_sample` levels (rows sample-major), on the
    actor's device, with the rollout policy's velocities there."""

    clean: torch.Tensor
    noisy: torch.Tensor
    sigmas: torch.Tensor
    cond: Conditioning
    optimality: torch.Tensor
    old_velocity: torch.Tensor


def noised(worker, batch: NFTBatch, seed: int, first: int, total: int) -> NoisedBatch:
    algo, n = worker.cfg.algorithm, len(batch)
    k, shape = algo.timesteps_per_sample, batch.clean.shape[1:]
    sigmas, noise = forward_noise(algo, total, shape, seed, first, n)
    clean = worker.to_device(batch.clean).repeat_interleave(k, dim=0)
    sigmas, noise = worker.to_device(sigmas.reshape(-1)), worker.to_device(noise.reshape(n * k, *shape))
    noisy = noisy_latents(clean, noise, sigmas)
    cond = batch.cond.apply(lambda t: worker.to_device(t).repeat_interleave(k, dim=0))
    with torch.no_grad():  # before any optimizer step: the rollout policy's
        old = [
            worker.velocity(noisy[rows], sigmas[rows], cond.apply(lambda t, rows=rows: t[rows]), batch.guidance_scale)
            for rows in torch.arange(n * k).split(worker.cfg.trainer.micro_batch_size)
        ]
    return NoisedBatch(
        clean, noisy, sigmas, cond, worker.to_device(batch.optimality).repeat_interleave(k), torch.cat(old)
    )


def minibatch_step(worker, data: NoisedBatch, minibatch: torch.Tensor, guidance_scale: float) -> Dict[str, float]:
    """One optimizer step of DiffusionNFT's loss on rows `minibatch`, in micro-batches."""
    algo = worker.cfg.algorithm
    sums: Dict[str, torch.Tensor] = {}
    worker.zero_grad()
    chunks = minibatch.split(worker.cfg.trainer.micro_batch_size)
    for i, rows in enumerate(chunks):
        velocity = worker.velocity(
            data.noisy[rows], data.sigmas[rows], data.cond.apply(lambda t, rows=rows: t[rows]), guidance_scale
        )
        loss, pos, neg = nft_loss(
            velocity, data.old_velocity[rows], data.noisy[rows], data.sigmas[rows], data.clean[rows],
            data.optimality[rows], algo.beta, algo.adv_clip_max,
        )  # fmt: skip
        weight = len(rows) / len(minibatch)
        worker.backward(loss * weight, sync=i == len(chunks) - 1)
        for key, value in (("loss", loss), ("positive_error", pos), ("negative_error", neg)):
            sums[key] = sums.get(key, 0.0) + value.detach().double() * weight
    grad_norm = worker.optimizer_step()
    metrics = {key: float(value) for key, value in sums.items()}
    return {**metrics, "grad_norm": grad_norm, "skipped_nonfinite": float(not math.isfinite(grad_norm))}


def update(worker, batch: NFTBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """DiffusionNFT's update: the rollout policy's velocities first (no gradient), then
    `num_inner_epochs` passes of `num_minibatches` optimizer steps over the noised samples."""
    algo = worker.cfg.algorithm
    data = noised(worker, batch, seed, first, total or len(batch))
    generator = seeding.seeded_generator(seed, first, seeding.MINIBATCHES)
    totals: Dict[str, List[float]] = {}
    for _ in range(algo.num_inner_epochs):
        for minibatch in torch.randperm(len(data.noisy), generator=generator).tensor_split(algo.num_minibatches):
            for key, value in minibatch_step(worker, data, minibatch, batch.guidance_scale).items():
                totals.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


# ----------------------------------------------------------------- the step, on the driver
class DiffusionNFT(Algorithm):
    """prompts -> ODE rollout (no log-probs) -> reward -> group advantages -> optimality
    probabilities -> forward-process update of the LoRA -> weight sync."""

    Options = DiffusionNFTConfig  # its options: schema/algorithm/diffusion_nft
    # No behaviour log-probs: v_old is the update's starting weights, which it computes itself,
    # so a batch sampled with older weights (trainer.rollout_mode=async) is data like any other
    supports_async = True

    @classmethod
    def check_config(cls, cfg) -> None:
        algo, rollout = cfg.algorithm, cfg.rollout
        check_groups(algo.group_size, cfg.trainer.batch_size)
        require(algo.beta > 0, f"algorithm.beta={algo.beta} must be positive")
        require(algo.adv_clip_max > 0, f"algorithm.adv_clip_max={algo.adv_clip_max} must be positive")
        require(
            algo.timesteps_per_sample >= 1, f"algorithm.timesteps_per_sample={algo.timesteps_per_sample} must be >= 1"
        )
        require(algo.num_inner_epochs >= 1, f"algorithm.num_inner_epochs={algo.num_inner_epochs} must be >= 1")
        require(algo.num_minibatches >= 1, f"algorithm.num_minibatches={algo.num_minibatches} must be >= 1")
        require(
            rollout.sde_type == SDEType.sde,
            f"rollout.sde_type={rollout.sde_type.value} with algorithm=diffusion_nft: "
            "DiffusionNFT samples with the ODE and takes no stochastic step; leave rollout.sde_type at its default",
        )
        # a guidance-distilled family (FLUX.1-dev, Kontext) takes its scale as an input, in one pass
        require(
            get_family(cfg.model.family).forward_passes(rollout.guidance_scale) == 1,
            f"rollout.guidance_scale={rollout.guidance_scale} with algorithm=diffusion_nft: DiffusionNFT samples and "
            f"trains without CFG; set rollout.guidance_scale=1",
        )

    def rollout(self, step: int, ctx=None):
        """Step `step`'s groups, sampled with the ODE (every step), and scored."""
        return grouped_rollout(ctx or self.ctx, step, self.cfg.algorithm.group_size, (0, 0))

    def step(self, step: int) -> Dict[str, float]:
        algo, worker = self.cfg.algorithm, self.ctx.worker
        rollout, staleness = self.next_rollout(step)
        advantages, advantage_metrics = rollout.advantages(algo.group_size, self.cfg.reward.aggregation, algo.adv_norm)
        r = optimality(clip_advantages(advantages, algo.adv_clip_max), algo.adv_clip_max)
        keep = rollout.valid  # an image without a finite reward sits the update out
        cond = rollout.batch.cond.apply(lambda t: t[keep])
        batch = NFTBatch(rollout.batch.latents[keep, -1], cond, r[keep], rollout.batch.options.guidance_scale)
        tick = time.perf_counter()
        metrics = worker.apply_update(update, batch, update_seed(self.cfg.seed, step))
        timings = {**rollout.timings, "time/update": time.perf_counter() - tick}
        timings.update(sync_engine(worker))
        train = {f"train/{k}": v for k, v in metrics.items()}
        return {**rollout.reward_metrics(), **advantage_metrics, **train, **timings, **staleness}


ALGORITHM = DiffusionNFT
