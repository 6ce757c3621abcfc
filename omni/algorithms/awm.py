"""Advantage Weighted Matching (Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with
Pretraining in Diffusion Models", arXiv:2509.25050): policy-gradient RL whose loss is the
pretraining loss itself, flow matching on the model's own samples, each sample weighted by its
advantage.

The paper shows that DDPO-style losses (Flow-GRPO's per-step log-probs) are flow matching
with a noisy target, the stored next latent, which raises the variance; AWM matches against
the clean sample instead. Each prompt's `group_size` images (ODE samples by default, any
sampler will do) get group advantages A (as Flow-GRPO's), clipped to +-c (`adv_clip_max`) and
scaled to weights w = clip(A, -c, c) / c in [-1, 1]. Each clean latent x0 is noised at K
(`timesteps_per_sample`) levels t, x_t = (1 - t) x0 + t eps, and the policy's velocity is
scored against the flow-matching target eps - x0:

    e(x0, t, eps) = mean over latent elements of |v_theta(x_t, t) - (eps - x0)|^2
    (weighting=ghuber: t ((e + d)^p - d^p) / p, the public code's robust variant, p = ghuber_power)

With rho = exp(e_old - e) (e_old: the same error under the rollout policy, before any optimizer
step; rho = 1 on the first one), the loss is PPO's pessimistic surrogate on rho plus two
velocity-distance penalties:

    loss = mean over (sample, level) of max(-w rho, -w clip(rho, 1 - eps, 1 + eps))
           + kl_coef     mean |v_theta - v_ref|^2     (reference: the base, the LoRA disabled)
           + ema_kl_coef mean |v_theta - v_ema|^2     (an EMA of the policy, a frozen snapshot)

At rho = 1 the surrogate's gradient is w grad(e): a positive-advantage image's matching error
goes down (the model is pulled towards it), a negative one's up (pushed away), which is
advantage-weighted flow matching. The regularisation is the public code's: both penalties on
the predicted velocities, the EMA updated after each step as
ema <- d ema + (1 - d) policy with d = min(ema_kl_decay, ema_kl_decay_ramp x updates so far)
(`ema_kl_decay_ramp=0`: d = ema_kl_decay), so it trails the policy by a few steps and acts as
a trust region; the EMA is not the sampler (the code's off-policy option is not reproduced).
The noise levels are stratified over K bins: the rollout's own noise levels (`schedule`, the
steps 1 .. fraction x num_steps, without the pure-noise one) or a continuous law (uniform or
logit-normal) shifted as SD3 shifts its schedule, t -> s t / (1 + (s - 1) t).

    python recipes/train.py algorithm=awm
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional, Tuple

import torch

from omni import seeding
from omni.algorithms.advantages import clip_advantages
from omni.algorithms.base import Algorithm, grouped_rollout, sync_engine
from omni.algorithms.dpo import SIGMA_EPS, noisy_latents, velocity_target
from omni.algorithms.flow_grpo import check_groups, velocity_kl
from omni.config.algorithm import GroupAdvantageConfig
from omni.config.errors import require
from omni.config.rollout import SDEType
from omni.context import update_seed
from omni.models.base import Conditioning

EMA_SNAPSHOT = "awm_ema_snapshot"  # the worker's frozen adapter holding the EMA of the policy
GHUBER_DELTA = 1e-10


class AWMTimesteps(str, Enum):
    schedule = "schedule"  # the rollout's own noise levels (the paper's SD3 runs)
    uniform = "uniform"
    logit_normal = "logit_normal"  # SD3's training law: sigmoid of a normal


class MatchingWeight(str, Enum):
    uniform = "uniform"  # the plain squared error (the paper's loss)
    ghuber = "ghuber"  # t ((e + d)^p - d^p) / p (the public code's setting)


class RolloutSampler(str, Enum):
    ode = "ode"  # deterministic: the images evaluation would draw
    sde = "sde"  # every step stochastic (rollout.sde_type, rollout.noise_level): more diverse groups


@dataclass
class AWMConfig(GroupAdvantageConfig):
    """AWM: advantage-weighted flow matching on the policy's own samples (the clipped
    advantages divided by adv_clip_max are the weights, in [-1, 1])."""

    # PPO's clip of the ratio exp(e_old - e) of the matching errors.
    clip_range: float = 1.0
    # Noise levels per clean latent, drawn stratified from this law.
    timesteps_per_sample: int = 6
    timestep_sampling: AWMTimesteps = AWMTimesteps.schedule
    # schedule: levels from the rollout's steps 1 .. int(fraction x rollout.num_steps) - 1.
    timestep_fraction: float = 0.9
    # uniform / logit_normal: the schedule shift s of t -> s t / (1 + (s - 1) t) (1: none).
    timestep_shift: float = 3.0
    weighting: MatchingWeight = MatchingWeight.uniform
    ghuber_power: float = 0.25
    # Weight of |v - v_ref|^2 (the reference: the LoRA disabled).
    kl_coef: float = 0.003
    # Weight of |v - v_ema|^2, and the EMA's decay: min(ema_kl_decay, ema_kl_decay_ramp x updates).
    ema_kl_coef: float = 1.0
    ema_kl_decay: float = 0.3
    ema_kl_decay_ramp: float = 0.001
    sampler: RolloutSampler = RolloutSampler.ode
    num_inner_epochs: int = 1
    num_minibatches: int = 1


# ----------------------------------------------------------------- the loss, on tensors
def shift_levels(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's schedule shift t -> s t / (1 + (s - 1) t)."""
    return shift * t / (1 + (shift - 1) * t)


def stratified_levels(
    n: int, k: int, algo, schedule: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """(n, k) noise levels: for each sample one draw u in each of k equal bins of [0, 1), mapped
    to the rollout's levels `schedule` (its steps 1 .. J - 1, J = int(fraction x steps)) or
    through the law's quantile and the shift."""
    u = (torch.arange(k) + torch.rand((n, k), generator=generator)) / k
    mode = AWMTimesteps(algo.timestep_sampling)
    if mode == AWMTimesteps.schedule:
        stop = max(2, int((len(schedule) - 1) * algo.timestep_fraction))
        return schedule.float()[1 + (u * (stop - 1)).long().clamp(max=stop - 2)]
    if mode == AWMTimesteps.logit_normal:
        u = torch.sigmoid(math.sqrt(2) * torch.erfinv((2 * u - 1).clamp(-1 + 1e-7, 1 - 1e-7)))
    return shift_levels(u, algo.timestep_shift).clamp(SIGMA_EPS, 1 - SIGMA_EPS)


def matching_error(
    velocity: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor, weighting="uniform", power: float = 0.25
) -> torch.Tensor:
    """Per row: the flow-matching error e = mean |v - target|^2, or with `ghuber`
    t ((e + d)^p - d^p) / p."""
    error = ((velocity - target) ** 2).mean(dim=tuple(range(1, velocity.ndim)))
    if MatchingWeight(weighting) == MatchingWeight.uniform:
        return error
    return sigmas * ((error + GHUBER_DELTA) ** power - GHUBER_DELTA**power) / power


def awm_policy_loss(error: torch.Tensor, old_error: torch.Tensor, weights: torch.Tensor, clip_range: float):
    """PPO's pessimistic surrogate on rho = exp(e_old - e), averaged over rows ->
    (loss, rho, clip fraction). Its gradient at rho = 1 is w grad(e) / rows."""
    ratio = torch.exp(old_error.detach() - error)
    unclipped = -weights * ratio
    clipped = -weights * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    return loss, ratio, ((ratio - 1).abs() > clip_range).float().mean()


def awm_loss(velocity, target, sigmas, old_error, weights, algo, ref_velocity=None, ema_velocity=None):
    """AWM's loss on rows (the surrogate plus the two velocity penalties) -> (loss, metrics)."""
    error = matching_error(velocity, target, sigmas, algo.weighting, algo.ghuber_power)
    policy, ratio, clip_fraction = awm_policy_loss(error, old_error, weights, algo.clip_range)
    zero = torch.zeros((), device=velocity.device)
    kl = velocity_kl(velocity, ref_velocity).mean() if ref_velocity is not None else zero
    kl_ema = velocity_kl(velocity, ema_velocity).mean() if ema_velocity is not None else zero
    loss = policy + algo.kl_coef * kl + algo.ema_kl_coef * kl_ema
    metrics = {"policy_loss": policy, "matching_error": error.mean(), "ratio": ratio.mean(),
               "clip_fraction": clip_fraction, "kl": kl, "kl_ema": kl_ema}  # fmt: skip
    return loss, metrics


# ----------------------------------------------------------------- the update, on a worker
@dataclass
class AWMBatch:
    """Clean latents of the rollouts, their conditioning, advantage weights, and the rollout's
    noise levels (the `schedule` law draws from them)."""

    clean: torch.Tensor  # (B, *latent)
    cond: Conditioning
    weights: torch.Tensor  # (B,) clip(A) / adv_clip_max
    guidance_scale: float
    schedule: torch.Tensor  # (T + 1,)

    def __len__(self) -> int:
        return len(self.clean)

    def select(self, rows) -> "AWMBatch":
        cond = self.cond.apply(lambda t: t[rows].clone())
        return AWMBatch(self.clean[rows].clone(), cond, self.weights[rows].clone(), self.guidance_scale, self.schedule)


def draw_noise(algo, schedule: torch.Tensor, n_total: int, shape, seed: int, first: int, n: int):
    """Each sample's levels (n, K) and noises (n, K, *latent), drawn for the whole batch and cut
    to rows [first, first + n), so sharding does not change them."""
    generator = torch.Generator().manual_seed(seed)
    k = algo.timesteps_per_sample
    sigmas = stratified_levels(n_total, k, algo, schedule, generator)
    noise = torch.randn((n_total, k, *shape), generator=generator)
    return sigmas[first : first + n], noise[first : first + n]


@dataclass
class MatchingRows:
    """Each clean latent noised at its K levels (rows sample-major) on the actor's device, with
    what stays fixed through the update: the rollout policy's errors, and the reference's and
    the EMA's velocities (None without their penalty)."""

    noisy: torch.Tensor
    target: torch.Tensor
    sigmas: torch.Tensor
    cond: Conditioning
    weights: torch.Tensor
    old_error: torch.Tensor
    ref_velocity: Optional[torch.Tensor]
    ema_velocity: Optional[torch.Tensor]

    def rows(self, rows) -> dict:
        fixed = {name: getattr(self, name) for name in ("ref_velocity", "ema_velocity")}
        return {
            "target": self.target[rows], "sigmas": self.sigmas[rows], "old_error": self.old_error[rows],
            "weights": self.weights[rows], **{k: None if v is None else v[rows] for k, v in fixed.items()},
        }  # fmt: skip


@torch.no_grad()
def fixed_velocities(worker, noisy, sigmas, cond: Conditioning, guidance_scale: float, **which) -> torch.Tensor:
    """The velocities of every row under the policy as it is now, the reference or a snapshot."""
    parts = [
        worker.velocity(noisy[rows], sigmas[rows], cond.apply(lambda t, rows=rows: t[rows]), guidance_scale, **which)
        for rows in torch.arange(len(noisy)).split(worker.cfg.trainer.micro_batch_size)
    ]
    return torch.cat(parts)


def matching_rows(worker, batch: AWMBatch, seed: int, first: int, total: int) -> MatchingRows:
    algo, n = worker.cfg.algorithm, len(batch)
    k, shape = algo.timesteps_per_sample, batch.clean.shape[1:]
    sigmas, noise = draw_noise(algo, batch.schedule, total, shape, seed, first, n)
    clean = worker.to_device(batch.clean).repeat_interleave(k, dim=0)
    sigmas, noise = worker.to_device(sigmas.reshape(-1)), worker.to_device(noise.reshape(n * k, *shape))
    noisy, target = noisy_latents(clean, noise, sigmas), velocity_target(clean, noise)
    cond = batch.cond.apply(lambda t: worker.to_device(t).repeat_interleave(k, dim=0))
    scale = batch.guidance_scale
    old = matching_error(fixed_velocities(worker, noisy, sigmas, cond, scale), target, sigmas, algo.weighting,
                         algo.ghuber_power)  # fmt: skip
    ref = fixed_velocities(worker, noisy, sigmas, cond, scale, reference=True) if algo.kl_coef > 0 else None
    ema = fixed_velocities(worker, noisy, sigmas, cond, scale, snapshot=EMA_SNAPSHOT) if algo.ema_kl_coef > 0 else None
    weights = worker.to_device(batch.weights).repeat_interleave(k)
    return MatchingRows(noisy, target, sigmas, cond, weights, old, ref, ema)


def minibatch_step(worker, data: MatchingRows, minibatch: torch.Tensor, guidance_scale: float) -> Dict[str, float]:
    """One optimizer step of AWM's loss on rows `minibatch`, in micro-batches."""
    algo = worker.cfg.algorithm
    sums: Dict[str, torch.Tensor] = {}
    worker.zero_grad()
    chunks = minibatch.split(worker.cfg.trainer.micro_batch_size)
    for i, rows in enumerate(chunks):
        cond = data.cond.apply(lambda t, rows=rows: t[rows])
        velocity = worker.velocity(data.noisy[rows], data.sigmas[rows], cond, guidance_scale)
        loss, metrics = awm_loss(velocity, algo=algo, **data.rows(rows))
        weight = len(rows) / len(minibatch)
        worker.backward(loss * weight, sync=i == len(chunks) - 1)
        for key, value in {"loss": loss, **metrics}.items():
            sums[key] = sums.get(key, 0.0) + value.detach().double() * weight
    grad_norm = worker.optimizer_step()
    metrics = {key: float(value) for key, value in sums.items()}
    return {**metrics, "grad_norm": grad_norm, "skipped_nonfinite": float(not math.isfinite(grad_norm))}


def update(worker, batch: AWMBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """AWM's update: the fixed quantities first (no gradient), then `num_inner_epochs` passes
    of `num_minibatches` optimizer steps over the noised samples."""
    algo = worker.cfg.algorithm
    data = matching_rows(worker, batch, seed, first, total or len(batch))
    generator = seeding.seeded_generator(seed, first, seeding.MINIBATCHES)
    totals: Dict[str, List[float]] = {}
    for _ in range(algo.num_inner_epochs):
        for minibatch in torch.randperm(len(data.noisy), generator=generator).tensor_split(algo.num_minibatches):
            for key, value in minibatch_step(worker, data, minibatch, batch.guidance_scale).items():
                totals.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


# ----------------------------------------------------------------- the step, on the driver
def ema_decay(algo, updates: int) -> float:
    """The EMA's decay after `updates` updates: min(ema_kl_decay, ema_kl_decay_ramp x updates)."""
    return (
        algo.ema_kl_decay if algo.ema_kl_decay_ramp == 0 else min(algo.ema_kl_decay, algo.ema_kl_decay_ramp * updates)
    )


@torch.no_grad()
def blend(average: Dict[str, torch.Tensor], lora: Dict[str, torch.Tensor], decay: float) -> None:
    """average <- decay average + (1 - decay) lora, in place (fp32)."""
    for name, tensor in lora.items():
        average[name].mul_(decay).add_(tensor.float(), alpha=1 - decay)


class AWM(Algorithm):
    """prompts -> rollout (ODE by default) -> reward -> group advantages -> advantage-weighted
    flow matching on the clean latents -> weight sync -> the EMA snapshot follows the policy."""

    Options = AWMConfig  # its options: schema/algorithm/awm

    def __init__(self, ctx):
        super().__init__(ctx)
        self.ema: Optional[Dict[str, torch.Tensor]] = None  # the EMA of the LoRA, whole fp32 tensors

    @classmethod
    def samples_stochastically(cls, cfg) -> bool:
        return RolloutSampler(cfg.algorithm.sampler) == RolloutSampler.sde

    @classmethod
    def check_config(cls, cfg) -> None:
        algo, rollout = cfg.algorithm, cfg.rollout
        check_groups(algo.group_size, cfg.trainer.batch_size)
        for key in ("adv_clip_max", "clip_range", "timestep_shift"):
            require(getattr(algo, key) > 0, f"algorithm.{key}={getattr(algo, key)} must be positive")
        for key in ("kl_coef", "ema_kl_coef", "ema_kl_decay_ramp"):
            require(getattr(algo, key) >= 0, f"algorithm.{key}={getattr(algo, key)} must be >= 0")
        for key in ("timesteps_per_sample", "num_inner_epochs", "num_minibatches"):
            require(getattr(algo, key) >= 1, f"algorithm.{key}={getattr(algo, key)} must be >= 1")
        require(0 <= algo.ema_kl_decay < 1, f"algorithm.ema_kl_decay={algo.ema_kl_decay} must be in [0, 1)")
        require(0 < algo.ghuber_power <= 1, f"algorithm.ghuber_power={algo.ghuber_power} must be in (0, 1]")
        require(
            0 < algo.timestep_fraction <= 1, f"algorithm.timestep_fraction={algo.timestep_fraction}: expected (0, 1]"
        )
        if AWMTimesteps(algo.timestep_sampling) == AWMTimesteps.schedule:
            require(
                int(rollout.num_steps * algo.timestep_fraction) >= 2,
                f"algorithm.timestep_fraction={algo.timestep_fraction} of rollout.num_steps={rollout.num_steps} "
                "leaves no noise level below the first (timestep_sampling=schedule needs int(fraction x steps) >= 2)",
            )
        require(
            algo.ema_kl_coef == 0 or cfg.model.lora is not None,
            f"algorithm.ema_kl_coef={algo.ema_kl_coef} with model.lora=null: the EMA is kept as a second LoRA "
            "adapter; set algorithm.ema_kl_coef=0 for full fine-tuning",
        )
        require(
            RolloutSampler(algo.sampler) == RolloutSampler.sde or rollout.sde_type == SDEType.sde,
            f"rollout.sde_type={rollout.sde_type.value} with algorithm=awm algorithm.sampler=ode: the rollout takes "
            "no stochastic step; set algorithm.sampler=sde to sample with it",
        )
        require(
            rollout.guidance_scale <= 1,
            f"rollout.guidance_scale={rollout.guidance_scale} with algorithm=awm: AWM matches the conditional "
            "velocity and samples without CFG; set rollout.guidance_scale=1",
        )

    @classmethod
    def uses_reference(cls, cfg) -> bool:
        return cfg.algorithm.kl_coef > 0

    @classmethod
    def snapshot_adapters(cls, cfg) -> Tuple[str, ...]:
        return (EMA_SNAPSHOT,) if cfg.algorithm.ema_kl_coef > 0 else ()

    def sde_steps(self, step: int) -> Tuple[int, int]:
        return (0, 0) if RolloutSampler(self.cfg.algorithm.sampler) == RolloutSampler.ode else self.ctx.sde_window(step)

    def step(self, step: int) -> Dict[str, float]:
        algo, worker = self.cfg.algorithm, self.ctx.worker
        rollout = grouped_rollout(self.ctx, step, algo.group_size, self.sde_steps(step))
        advantages, advantage_metrics = rollout.advantages(algo.group_size, self.cfg.reward.aggregation, algo.adv_norm)
        weights = clip_advantages(advantages, algo.adv_clip_max) / algo.adv_clip_max
        keep = rollout.valid  # an image without a finite reward sits the update out
        batch = AWMBatch(rollout.batch.latents[keep, -1], rollout.batch.cond.apply(lambda t: t[keep]), weights[keep],
                         rollout.batch.options.guidance_scale, rollout.batch.sigmas)  # fmt: skip
        if algo.ema_kl_coef > 0 and self.ema is None:  # the EMA starts at the policy
            self.set_ema({name: t.float().clone() for name, t in worker.lora_state_dict().items()})
        tick = time.perf_counter()
        metrics = worker.apply_update(update, batch, update_seed(self.cfg.seed, step))
        timings = {**rollout.timings, "time/update": time.perf_counter() - tick}
        if algo.ema_kl_coef > 0:
            metrics["ema_kl_decay"] = ema_decay(algo, step + 1)
            blend(self.ema, worker.lora_state_dict(), metrics["ema_kl_decay"])
            self.set_ema(self.ema)
        timings.update(sync_engine(worker))
        return {
            **rollout.reward_metrics(),
            **advantage_metrics,
            **{f"train/{k}": v for k, v in metrics.items()},
            **timings,
        }

    def set_ema(self, ema: Dict[str, torch.Tensor]) -> None:
        self.ema = ema
        self.ctx.worker.load_snapshot(EMA_SNAPSHOT, ema)

    def state_dict(self) -> Dict[str, object]:
        return {"ema": self.ema} if self.ema is not None else {}

    def load_state_dict(self, state: Dict[str, object], step: int) -> None:
        """The checkpoint's EMA; without one (the EMA penalty was off) it restarts at the policy."""
        self.ema = None
        if state.get("ema") is not None and self.cfg.algorithm.ema_kl_coef > 0:
            self.set_ema({name: t.float().clone() for name, t in state["ema"].items()})


ALGORITHM = AWM
