"""Flow-GRPO (Liu et al. 2025) and its Fast window: clipped ratio loss, KL, the update on a
worker, and the training step.

GRPO needs no value network: each prompt is sampled `group_size` times and an image's
advantage is its reward minus its group's mean, divided by the group's std, the batch's std,
or nothing (`algorithm.adv_norm`; with several rewards, summed before or after that
normalisation, `reward.aggregation`: omni/algorithms/advantages.py). The policy gradient is
PPO's clipped importance-ratio loss, applied per denoising step, with an optional penalty
`kl_coef` x KL to the reference: between the policy's and the reference's Gaussian steps
(`algorithm.kl_type=latent`, the paper's), or the squared distance of their predicted
velocities (`kl_type=velocity`: independent of the noise level and the step size, and of the
sampler). Flow-GRPO-Fast samples with the SDE (and trains) only on a window of the steps.

    python recipes/train.py algorithm=flow_grpo            # or algorithm=flow_grpo_fast
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from omni import seeding
from omni.algorithms.advantages import clip_advantages
from omni.algorithms.base import Algorithm, ScoredRollout, grouped_rollout, sync_engine
from omni.config.algorithm import CFGGradient, GroupAdvantageConfig, KLType
from omni.config.errors import require
from omni.context import StepContext, update_seed
from omni.models import get_family
from omni.rollout.base import RolloutBatch
from omni.rollout.sde import noisy_steps, sde_step


@dataclass
class GroupPolicyConfig(GroupAdvantageConfig):
    """What every group-advantage, per-denoising-step policy algorithm shares."""

    # Weight of the KL to the reference (the same transformer, adapters disabled).
    kl_coef: float = 0.0
    # What the KL compares (see KLType).
    kl_type: KLType = KLType.latent
    # Flow-GRPO-Fast: SDE only on a window of this many steps (0: every step is SDE).
    sde_window_size: int = 0
    # Range [lo, hi] of the steps the window may start at (drawn per rollout batch).
    sde_window_range: Optional[List[int]] = None
    # Passes over each rollout batch, each split into this many optimizer steps.
    num_inner_epochs: int = 1
    num_minibatches: int = 2
    # Under classifier-free guidance, the gradient through both passes or the conditional one.
    cfg_gradient: CFGGradient = CFGGradient.both


@dataclass
class FlowGRPOConfig(GroupPolicyConfig):
    """Flow-GRPO and GRPO-Guard: PPO's ratio clipping."""

    clip_range: float = 1e-4


def clipped_policy_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
):
    """PPO's pessimistic surrogate, averaged over samples. Returns (loss, ratio, clip fraction)."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    clip_fraction = ((ratio - 1).abs() > clip_range).float().mean()
    return loss, ratio, clip_fraction


def gaussian_step_kl(mean: torch.Tensor, ref_mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, s^2) || N(ref_mean, s^2)) per sample, averaged over latent elements
    (the two steps share the SDE's scale s)."""
    kl = (mean - ref_mean) ** 2 / (2 * scale**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


# ----------------------------------------------------------------- the update, on a worker
@dataclass
class GRPOBatch:
    """A rollout batch and its advantages: what a worker's update needs."""

    rollout: RolloutBatch
    # (B,): each sample's advantage, for all its steps; or (B, T): each transition's (TreeGRPO)
    advantages: torch.Tensor
    # Per sample, the weight of its KL to the reference (GARDO's gate); None: 1 for every sample.
    kl_weights: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.rollout)

    def select(self, rows: slice) -> "GRPOBatch":
        kl_weights = None if self.kl_weights is None else self.kl_weights[rows].clone()
        return GRPOBatch(self.rollout.select(rows, with_images=False), self.advantages[rows].clone(), kl_weights)


def minibatch_rows(n_samples: int, sde_steps, num_minibatches: int, seed: int, first_sample: int = 0):
    """(samples, steps) of each minibatch of one pass over a batch of `n_samples` trajectories.

    Every sample's SDE steps are shuffled by a generator of its own, seeded by `seed` and the
    sample's index in the whole batch (`first_sample` + i), and minibatch m takes the m-th
    share of each sample's steps. A worker holding a shard of the samples therefore holds the
    same share of every minibatch as the others, and the union over workers is exactly the
    minibatch one worker builds from the whole batch: sharding does not change the update.
    """
    start, stop = sde_steps
    samples: List[List[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    steps: List[List[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    for i in range(n_samples):
        generator = torch.Generator().manual_seed(
            seeding.derive_seed(seed, first_sample + i, seeding.SAMPLE_STEPS) % 2**63
        )
        order = torch.randperm(stop - start, generator=generator) + start
        for m, share in enumerate(order.tensor_split(num_minibatches)):
            samples[m].append(torch.full_like(share, i))
            steps[m].append(share)
    minibatches = [(torch.cat(s), torch.cat(j)) for s, j in zip(samples, steps)]
    return [(s, j) for s, j in minibatches if len(s)]


@dataclass
class ScoredSteps:
    """The actor's (or the reference's) Gaussian steps on stored transitions, fp32."""

    log_prob: torch.Tensor  # (n,) log-density of the stored next latent, averaged over elements
    mean: torch.Tensor  # (n, *latent) the step's mean
    scale: torch.Tensor  # the step's standard deviation, broadcastable to `mean`
    velocity: torch.Tensor  # (n, *latent) the predicted velocity the step came from


def score_steps(
    worker,
    rollout: RolloutBatch,
    samples: torch.Tensor,
    steps: torch.Tensor,
    reference: bool = False,
    rollout_uncond: bool = False,
) -> ScoredSteps:
    """The Gaussian step of each stored transition (sample i, step j) under the policy (with
    gradients) or the reference (adapters disabled, no gradients). `rollout_uncond`: take
    the guidance's unconditional velocity from the rollout (`RolloutBatch.uncond_velocities`),
    valid while the weights are the rollout's."""
    opts = rollout.options
    latents = worker.to_device(rollout.latents[samples, steps])
    next_latents = worker.to_device(rollout.latents[samples, steps + 1])
    sigma, sigma_next = rollout.sigmas[steps], rollout.sigmas[steps + 1]
    cond = rollout.cond.apply(lambda t: worker.to_device(t[samples]))
    uncond_grad = CFGGradient(worker.cfg.algorithm.cfg_gradient) == CFGGradient.both
    uncond = None
    if rollout_uncond and not reference:
        uncond = worker.to_device(rollout.uncond_velocities[samples, steps - opts.sde_steps[0]])
    velocity = worker.velocity(
        latents, sigma, cond, opts.guidance_scale, reference=reference, uncond_grad=uncond_grad, uncond=uncond
    )
    _, log_prob, mean, scale = sde_step(
        velocity,
        latents,
        sigma,
        sigma_next,
        float(rollout.sigmas[1]),
        opts.noise_level,
        next_sample=next_latents,
        sde_type=opts.sde_type,
    )
    return ScoredSteps(log_prob, mean, scale, velocity)


def reference_kl(policy: ScoredSteps, ref: ScoredSteps, kl_type: str = "latent") -> torch.Tensor:
    """Per-sample divergence of the policy from the reference: the Gaussian KL of their steps
    ("latent", Flow-GRPO) or the squared distance of their predicted velocities ("velocity":
    it does not depend on the SDE's noise scale, nor on the sampler, so the LoRA stays close
    to the base in the quantity CFG combines at test time)."""
    kl_type = getattr(kl_type, "value", kl_type)
    if kl_type == "latent":
        return gaussian_step_kl(policy.mean, ref.mean, policy.scale)
    if kl_type == "velocity":
        return velocity_kl(policy.velocity, ref.velocity)
    raise ValueError(f"KL type {kl_type!r}: expected latent or velocity")


def velocity_kl(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """mean over latent elements of (v - v_ref)^2, per sample."""
    return ((velocity - ref_velocity) ** 2).mean(dim=tuple(range(1, velocity.ndim)))


def score_transitions(
    worker,
    rollout: RolloutBatch,
    samples: torch.Tensor,
    steps: torch.Tensor,
    with_reference: bool,
    kl_type: str = "latent",
):
    """The actor's log-probs of the stored transitions (sample i, step j), and its KL to the
    reference (zeros without the reference) -> (log_prob, kl), fp32."""
    policy = score_steps(worker, rollout, samples, steps)
    if not with_reference:
        return policy.log_prob, torch.zeros_like(policy.log_prob)
    return policy.log_prob, reference_kl(policy, score_steps(worker, rollout, samples, steps, reference=True), kl_type)


@dataclass
class OldSteps:
    """What the rollout policy did on one micro-batch's transitions (on the actor's device)."""

    log_prob: torch.Tensor  # (n,) the engine's log-probs
    advantages: torch.Tensor  # (n,) each transition's sample's advantage
    mean: Optional[torch.Tensor] = None  # (n, *latent) its step means, for losses that compare them


def clipped_loss(policy: ScoredSteps, old: OldSteps, algo) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Flow-GRPO's policy loss: PPO's clipped ratio -> (loss, metrics)."""
    loss, ratio, clip_fraction = clipped_policy_loss(policy.log_prob, old.log_prob, old.advantages, algo.clip_range)
    return loss, {"clip_fraction": clip_fraction, "ratio": ratio.mean()}


def minibatch_step(
    worker, batch: GRPOBatch, samples, steps, policy_loss=clipped_loss, old_means=None, rollout_uncond: bool = False
) -> Dict[str, float]:
    """One optimizer step on the transitions (samples, steps), in micro-batches; the loss is
    `policy_loss(policy steps, old steps, algorithm config)` plus the KL penalty, each
    transition's KL weighted by its sample's `batch.kl_weights` when there are some (their
    mean is then the `kl_weighted` metric). `rollout_uncond`: see `score_steps`."""
    algo = worker.cfg.algorithm
    sums: Dict[str, torch.Tensor] = {}  # tensors: no device sync per micro-batch
    worker.zero_grad()
    chunks = torch.arange(len(samples)).split(worker.cfg.trainer.micro_batch_size)
    start = batch.rollout.options.sde_steps[0]
    for i, rows in enumerate(chunks):
        s, j = samples[rows], steps[rows]
        policy = score_steps(worker, batch.rollout, s, j, rollout_uncond=rollout_uncond)
        kl = torch.zeros_like(policy.log_prob)
        if algo.kl_coef > 0:
            kl = reference_kl(policy, score_steps(worker, batch.rollout, s, j, reference=True), algo.kl_type)
        device = policy.log_prob.device
        old = OldSteps(
            batch.rollout.log_probs[s, j].to(device),
            (batch.advantages[s] if batch.advantages.ndim == 1 else batch.advantages[s, j]).to(device),
            None if old_means is None else old_means[s, j - start],
        )
        main, extras = policy_loss(policy, old, algo)
        if batch.kl_weights is not None:
            extras["kl_weighted"] = (kl * batch.kl_weights[s].to(device)).mean()
        loss = main + algo.kl_coef * extras.get("kl_weighted", kl.mean())
        weight = len(rows) / len(samples)  # the mean over this worker's rows; FSDP averages the workers
        worker.backward(loss * weight, sync=i == len(chunks) - 1)
        for key, value in {"loss": loss, "kl": kl.mean(), **extras}.items():
            sums[key] = sums.get(key, 0.0) + value.detach().double() * weight
    grad_norm = worker.optimizer_step()
    metrics = {key: float(value) for key, value in sums.items()}
    return {**metrics, "grad_norm": grad_norm, "skipped_nonfinite": float(not math.isfinite(grad_norm))}


@torch.no_grad()
def rollout_step_means(worker, rollout: RolloutBatch) -> torch.Tensor:
    """The step means of every (sample, SDE step) of the batch under the current weights, which
    are the rollout's (the engine is synced after each update): (B, window, *latent). Losses that
    compare the policy's step with the rollout's (GRPO-Guard, Flow-DPPO) read them, as they
    change once the first minibatch has stepped the optimizer."""
    start, stop = rollout.options.sde_steps
    samples = torch.arange(len(rollout)).repeat_interleave(stop - start)
    steps = torch.arange(start, stop).repeat(len(rollout))
    chunks = torch.arange(len(samples)).split(worker.cfg.trainer.micro_batch_size)
    means = [score_steps(worker, rollout, samples[rows], steps[rows]).mean for rows in chunks]
    return torch.cat(means).reshape(len(rollout), stop - start, *means[0].shape[1:])


def run_update(
    worker,
    batch: GRPOBatch,
    seed: int,
    first: int,
    policy_loss=clipped_loss,
    needs_old_means: bool = False,
    plan=None,
):
    """Every (sample, SDE step) transition of the batch, `num_inner_epochs` times, each pass
    `num_minibatches` optimizer steps (see `minibatch_rows`) of `policy_loss`. A worker of a
    group holds rows [first, first + len(batch)) of the whole batch. `plan(n_samples,
    num_minibatches, seed, first)`: other transitions' minibatches, as `minibatch_rows` gives
    its own (TreeGRPO's branch steps)."""
    algo = worker.cfg.algorithm
    old_means = rollout_step_means(worker, batch.rollout) if needs_old_means else None
    totals: Dict[str, List[float]] = {}
    # until the first optimizer step the weights are the rollout's (the engine is synced after
    # every update), so the unconditional velocities the rollout kept are the policy's own
    unchanged = batch.rollout.uncond_velocities is not None
    for epoch in range(algo.num_inner_epochs):
        epoch_seed = seeding.derive_seed(seed, epoch, seeding.MINIBATCHES)
        if plan is None:
            minibatches = minibatch_rows(
                len(batch), batch.rollout.options.sde_steps, algo.num_minibatches, epoch_seed, first
            )
        else:
            minibatches = plan(len(batch), algo.num_minibatches, epoch_seed, first)
        for samples, steps in minibatches:
            for key, value in minibatch_step(worker, batch, samples, steps, policy_loss, old_means, unchanged).items():
                totals.setdefault(key, []).append(value)
            unchanged = False
    return {key: sum(values) / len(values) for key, values in totals.items()}


def update(worker, batch: GRPOBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """Flow-GRPO's update (the clipped ratio loss) on a worker."""
    return run_update(worker, batch, seed, first)


# ----------------------------------------------------------------- the step, on the driver
class FlowGRPO(Algorithm):
    """prompts -> SDE rollout -> reward -> group advantages -> clipped-ratio update of the
    LoRA -> weight sync into the rollout engine. Variants change only the worker-side
    `update` (a module-level function, so a Ray group can ship it)."""

    Options = FlowGRPOConfig  # its options: schema/algorithm/flow_grpo
    supports_async = True

    update = staticmethod(update)

    @classmethod
    def samples_stochastically(cls, cfg) -> bool:
        return True  # SDE steps on its window

    @classmethod
    def check_config(cls, cfg) -> None:
        require(cfg.algorithm.clip_range > 0, f"algorithm.clip_range={cfg.algorithm.clip_range} must be positive")
        check_policy_config(cfg)

    @classmethod
    def uses_reference(cls, cfg) -> bool:
        return cfg.algorithm.kl_coef > 0  # the KL penalty

    def window(self, step: int) -> Tuple[int, int]:
        """Step `step`'s SDE steps [start, stop): all, or Flow-GRPO-Fast's random window."""
        return self.ctx.sde_window(step, self.cfg.algorithm.sde_window_size, self.cfg.algorithm.sde_window_range)

    def rollout(self, step: int, ctx: Optional[StepContext] = None) -> ScoredRollout:
        """Step `step`'s groups, sampled with the SDE on its window (by `ctx`'s worker: the
        run's, or the rollout group's), and scored."""
        return grouped_rollout(ctx or self.ctx, step, self.cfg.algorithm.group_size, self.window(step))

    def update_batch(self, rollout: ScoredRollout) -> Tuple[GRPOBatch, Dict[str, float]]:
        """What the update trains on: the rollout with its clipped group advantages (and
        metrics of how they were made, per reward under reward.aggregation)."""
        algo = self.cfg.algorithm
        advantages, metrics = rollout.advantages(algo.group_size, self.cfg.reward.aggregation, algo.adv_norm)
        return GRPOBatch(rollout.batch, clip_advantages(advantages, algo.adv_clip_max)), metrics

    def step(self, step: int) -> Dict[str, float]:
        worker = self.ctx.worker
        rollout, staleness = self.next_rollout(step)
        batch, shaping = self.update_batch(rollout)
        tick = time.perf_counter()
        metrics = {**worker.apply_update(self.update, batch, update_seed(self.cfg.seed, step)), **shaping}
        timings = {**rollout.timings, "time/update": time.perf_counter() - tick}
        timings.update(sync_engine(worker))
        # the advantages' own metrics (reward/<name>/...) keep their names; the rest are the update's
        train = {k if k.startswith("reward/") else f"train/{k}": v for k, v in metrics.items()}
        return {**rollout.reward_metrics(), **train, **timings, **staleness}


def check_policy_config(cfg) -> None:
    """The rules every group-advantage, per-step policy algorithm shares: groups, epochs, the
    SDE window and its minibatches."""
    algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    check_groups(algo.group_size, trainer.batch_size)
    require(algo.num_inner_epochs >= 1, f"algorithm.num_inner_epochs={algo.num_inner_epochs} must be >= 1")
    available = noisy_steps(rollout)
    steps_of = f"rollout.num_steps={rollout.num_steps}" + (
        f" (with rollout.sde_type=cps the last step, to sigma 0, has no noise: {available} stochastic steps)"
        if available < rollout.num_steps
        else ""
    )
    check_cfg_gradient(cfg)
    sde_steps = algo.sde_window_size or available
    require(
        1 <= algo.num_minibatches <= sde_steps,
        f"algorithm.num_minibatches={algo.num_minibatches}: each sample's {sde_steps} SDE steps are shared out "
        f"over the minibatches, so expected 1 to {sde_steps}",
    )
    if algo.sde_window_size > 0:
        require(
            algo.sde_window_size <= available,
            f"algorithm.sde_window_size={algo.sde_window_size} exceeds {steps_of}",
        )
        if algo.sde_window_range is not None:
            lo, hi = algo.sde_window_range
            require(
                0 <= lo <= hi and hi + algo.sde_window_size <= available,
                f"algorithm.sde_window_range={list(algo.sde_window_range)} does not fit a window of "
                f"{algo.sde_window_size} in {steps_of}",
            )


def check_cfg_gradient(cfg) -> None:
    """algorithm.cfg_gradient=conditional needs an unconditional pass to leave out."""
    if CFGGradient(cfg.algorithm.cfg_gradient) == CFGGradient.conditional:
        require(
            get_family(cfg.model.family).forward_passes(cfg.rollout.guidance_scale) == 2,
            f"algorithm.cfg_gradient=conditional: model.family={cfg.model.family} at rollout.guidance_scale="
            f"{cfg.rollout.guidance_scale} runs no unconditional pass (classifier-free guidance needs a scale above 1 "
            "and a family that guides with two passes, not FLUX's distilled guidance); leave "
            "algorithm.cfg_gradient=both",
        )


def check_groups(group_size: int, batch_size: int) -> None:
    require(group_size >= 2, f"algorithm.group_size={group_size}: a group needs at least 2 images per prompt")
    require(
        batch_size % group_size == 0,
        f"algorithm.group_size={group_size} does not divide trainer.batch_size={batch_size}",
    )


ALGORITHM = FlowGRPO
