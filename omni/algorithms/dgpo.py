"""DGPO (Luo, Hu and Tang 2025, "Reinforcing Diffusion Models by Direct Group Preference
Optimization", arXiv:2510.08425, ICLR 2026): online RL without a policy gradient, so the
rollouts may use the deterministic ODE sampler (no SDE, no log-probabilities), and training
needs one noise level per image, not the whole trajectory.

Each prompt's `group_size` images get group advantages A (as Flow-GRPO's, clipped to
+-adv_clip_max). The images with A > 0 form a positive group G+, those with A < 0 a negative
group G-, and the policy learns by maximum likelihood that G+ is preferred to G- (a
Bradley-Terry model of groups, as DPO's of pairs):

    loss = -log sigmoid(R(G+) - R(G-)),      R(G) = sum over x in G of w(x) r(x),  w(x) = |A(x)| / group_size

With these weights the partition function cancels between the two groups (the weights of
G+ and G- balance, as the advantages sum to 0), and R(G+) - R(G-) = 1/group_size sum_x A(x) r(x).
r(x) is Diffusion-DPO's implicit reward (Wallace et al. 2023; `omni.algorithms.dpo`): every
image of the group is noised at the same level sigma with the same noise eps,
x_t = (1 - sigma) x0 + sigma eps, and with e(x) = mean |v(x_t, sigma) - (eps - x0)|^2 the
velocity error of the policy and e_ref(x) that of the reference (the same transformer,
adapters disabled),

    r(x) = -beta (e(x) - e_ref(x))
    loss = mean over (group, noise level) of -log sigmoid(-beta / group_size * sum_x A(x) (e(x) - e_ref(x)))

so the policy lowers its error, relative to the reference, on the images better than their
group's mean and raises it on the worse ones, the more so where the group's preference is
not yet met. With a group of two and A = (1, -1) this is Diffusion-DPO's loss on the pair
with the same beta (`dpo.py` writes its implicit reward -beta/2 (e - e_ref) and its logit as
the pair's difference; here beta has DGPO's scale, so its authors' values, 10 to 100, carry
over). Rollouts may use CFG (`rollout.guidance_scale`); the policy and the reference are
scored without it, the authors' default.

Two stabilisers of the authors' code, outside the group preference objective, are options:

(a) A trust region on the errors (`clip_range`, null: none). With e_old(x) the policy's error
as it was when this step's update began (no gradient), the error playing -log p gives a
likelihood ratio rho(x) = exp(e_old(x) - e(x)), and an image stops passing gradient through
its error once the update has moved it far enough the way its advantage asks:

    clipped(x) = rho(x) > 1 + clip_range   where A(x) > 0
               = rho(x) < 1 - clip_range   where A(x) <= 0
    e(x) <- stop_gradient(e(x))            where clipped(x)

so the logit keeps its value and loses those images' gradients. It costs one more forward
pass (no gradient) per image and noise level. The authors' "old" policy is an EMA of the
policy (decay min(0.3, 0.001 x step), stepped after each optimizer step); here it is the
policy at the start of the update, PPO's: an update's first optimizer step never clips.

(b) A velocity KL to the reference (`kl_coef`), on the same noisy latents:

    loss += kl_coef x beta x mean over images of mean |v(x_t, sigma) - v_ref(x_t, sigma)|^2

with v_ref recomputed without gradient (one more forward pass per micro-batch). The authors
write their group loss as sigmoid(-logit) A e, whose gradient is this loss's divided by
beta, so their KL weight (0.02) carries over as kl_coef through the factor beta. The trust
region leaves the KL's gradient alone (their default).

The defaults are the authors' SD3.5 OCR and GenEval settings, clip_range 0.01 and kl_coef
0.02 (their compressibility setting: clip_range 0.05, no KL). Logged: `train/clip_fraction`
(the share of images whose error was clipped) and `train/kl` (the mean velocity KL), each
when its option is on.

    python recipes/train.py algorithm=dgpo
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from omni import seeding
from omni.algorithms.advantages import clip_advantages
from omni.algorithms.base import Algorithm, grouped_rollout, sync_engine
from omni.algorithms.dpo import REFERENCE_CHUNK, noisy_latents, per_sample_mse, sample_sigmas, velocity_target
from omni.algorithms.flow_grpo import check_groups
from omni.config.algorithm import GroupAdvantageConfig, SigmaSampling
from omni.config.errors import require
from omni.config.rollout import SDEType
from omni.context import update_seed
from omni.models.base import Conditioning


def group_logits(
    policy_err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor, group_size: int, beta: float
) -> torch.Tensor:
    """Per-image errors and advantages, `group_size` consecutive rows per group (and noise
    level) -> each group's R(G+) - R(G-) = -beta / group_size * sum A (e - e_ref)."""
    rewards = -beta * (policy_err - ref_err.detach())
    return (advantages * rewards).reshape(-1, group_size).mean(dim=1)


def dgpo_loss(
    policy_err: torch.Tensor,
    ref_err: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    beta: float,
    kl: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
) -> Dict[str, torch.Tensor]:
    """DGPO's loss, the mean over groups of -log sigmoid(R(G+) - R(G-)), plus kl_coef x beta x
    the mean of the per-image `kl` when given; only "loss" carries gradients. Metrics:
    implicit_accuracy (share of groups whose preference the policy meets, logit > 0; 0 at the
    start, where every logit is 0), reward_margin (the mean logit), the mean errors of the
    policy and the reference, and the mean kl."""
    shapes = [tuple(t.shape) for t in (policy_err, ref_err, advantages, *([] if kl is None else [kl]))]
    if len(set(shapes)) != 1 or policy_err.ndim != 1:
        raise ValueError(f"expected errors, advantages (and kl) of one shape (n,), got {shapes}")
    if policy_err.numel() % group_size:
        raise ValueError(f"{policy_err.numel()} rows do not split into groups of {group_size}")
    logits = group_logits(policy_err, ref_err, advantages, group_size, beta)
    loss = -F.logsigmoid(logits).mean()
    metrics = {
        "implicit_accuracy": (logits > 0).float().mean(),
        "reward_margin": logits.mean(),
        "policy_err": policy_err.mean(),
        "ref_err": ref_err.mean(),
    }
    if kl is not None:
        loss = loss + kl_coef * beta * kl.mean()
        metrics["kl"] = kl.mean()
    return {"loss": loss, **{k: v.detach() for k, v in metrics.items()}}


def clip_errors(
    policy_err: torch.Tensor, old_err: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The trust region: with rho = exp(e_old - e), an image whose ratio is past 1 + clip_range
    (A > 0) or below 1 - clip_range (A <= 0) keeps its error's value but not its gradient.
    Returns (errors, clipped mask)."""
    ratio = torch.exp(old_err.detach() - policy_err.detach())
    clipped = torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)
    return torch.where(clipped, policy_err.detach(), policy_err), clipped


# ----------------------------------------------------------------- the update, on a worker
@dataclass
class DGPOConfig(GroupAdvantageConfig):
    """DGPO: group preference optimisation on ODE rollouts."""

    # Temperature of the group preference (DGPO's beta: the pull towards the reference).
    beta: float = 100.0
    # Noise levels each group is trained at (each with one noise shared by the group), and how drawn.
    timesteps_per_group: int = 2
    sigma_sampling: SigmaSampling = SigmaSampling.uniform
    # Trust region: an image's error stops passing gradient once its ratio to the error at the
    # update's start leaves 1 +- this, the way its advantage pushes (null: no trust region).
    clip_range: Optional[float] = 0.01
    # Weight, in units of beta, of the velocity KL to the reference (0: none).
    kl_coef: float = 0.02
    # Passes over each rollout batch, each split into this many optimizer steps.
    num_inner_epochs: int = 1
    num_minibatches: int = 2


@dataclass
class GroupBatch:
    """The rollouts' clean latents, conditioning and advantages, group by group; its rows
    (`len`, `select`) are groups, so a Ray group shards whole groups."""

    clean: torch.Tensor  # (groups x group_size, *latent)
    cond: Conditioning
    advantages: torch.Tensor  # (groups x group_size,)
    group_size: int

    def __len__(self) -> int:
        return len(self.clean) // self.group_size

    def select(self, rows: slice) -> "GroupBatch":
        images = slice(rows.start * self.group_size, rows.stop * self.group_size)
        cond = self.cond.apply(lambda t: t[images].clone())
        return GroupBatch(self.clean[images].clone(), cond, self.advantages[images].clone(), self.group_size)


def group_noise(algo, n_total: int, shape, seed: int, first: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each group's `timesteps_per_group` noise levels and noises, drawn for the whole batch
    and cut to groups [first, first + n), so sharding does not change them:
    (sigmas (n x K,), noise (n x K, *latent)), one row per (group, level), group-major."""
    generator = torch.Generator().manual_seed(seed)
    k = algo.timesteps_per_group
    sigmas = sample_sigmas(n_total * k, algo.sigma_sampling, generator).reshape(n_total, k)
    noise = torch.randn((n_total, k, *shape), generator=generator)
    return sigmas[first : first + n].reshape(-1), noise[first : first + n].flatten(0, 1)


@dataclass
class Units:
    """The batch on this worker, cut into units: one group at one noise level. A unit's
    rows are its group's images, noised alike."""

    batch: GroupBatch
    sigmas: torch.Tensor  # (units,)
    noise: torch.Tensor  # (units, *latent)
    per_group: int  # noise levels per group

    def __len__(self) -> int:
        return len(self.sigmas)

    def inputs(self, worker, units: torch.Tensor):
        """The rows of `units` on the device: (noisy latents, sigmas, conditioning, target, advantages)."""
        g = self.batch.group_size
        images = ((units // self.per_group)[:, None] * g + torch.arange(g)).reshape(-1)
        clean = worker.to_device(self.batch.clean[images])
        noise = worker.to_device(self.noise[units].repeat_interleave(g, dim=0))
        sigmas = worker.to_device(self.sigmas[units].repeat_interleave(g))
        cond = self.batch.cond.apply(lambda t: worker.to_device(t[images]))
        advantages = worker.to_device(self.batch.advantages[images])
        return noisy_latents(clean, noise, sigmas), sigmas, cond, velocity_target(clean, noise), advantages


@torch.no_grad()
def unit_errors(worker, data: Units, reference: bool = True) -> torch.Tensor:
    """The reference's (or, `reference=False`, the policy's, without gradient) error on every
    row, units in order, in chunks of about REFERENCE_CHUNK images."""
    parts = []
    for units in torch.arange(len(data)).split(max(1, REFERENCE_CHUNK // data.batch.group_size)):
        noisy, sigmas, cond, target, _ = data.inputs(worker, units)
        parts.append(per_sample_mse(worker.velocity(noisy, sigmas, cond, 1.0, reference=reference), target))
    return torch.cat(parts)


@dataclass
class Baselines:
    """Per-row errors fixed for the whole update: the reference's, and the policy's at its start
    (None without the trust region)."""

    ref: torch.Tensor
    old: Optional[torch.Tensor]

    def rows(self, err: torch.Tensor, units: torch.Tensor, group_size: int) -> torch.Tensor:
        return err.reshape(-1, group_size)[units.to(err.device)].reshape(-1)


def unit_loss(worker, data: Units, baselines: Baselines, units: torch.Tensor) -> Dict[str, torch.Tensor]:
    """DGPO's loss on the rows of `units`, with the trust region and the KL where they are on."""
    algo, g = worker.cfg.algorithm, data.batch.group_size
    noisy, sigmas, cond, target, advantages = data.inputs(worker, units)
    velocity = worker.velocity(noisy, sigmas, cond, 1.0)
    policy_err = per_sample_mse(velocity, target)
    extras = {}
    if algo.clip_range is not None:
        old = baselines.rows(baselines.old, units, g)
        policy_err, clipped = clip_errors(policy_err, old, advantages, algo.clip_range)
        extras["clip_fraction"] = clipped.float().mean()
    kl = None
    if algo.kl_coef > 0:
        with torch.no_grad():
            ref_velocity = worker.velocity(noisy, sigmas, cond, 1.0, reference=True)
        kl = per_sample_mse(velocity, ref_velocity)
    out = dgpo_loss(policy_err, baselines.rows(baselines.ref, units, g), advantages, g, algo.beta, kl, algo.kl_coef)
    return {**out, **extras}


def minibatch_step(worker, data: Units, baselines: Baselines, minibatch: torch.Tensor) -> Dict[str, float]:
    """One optimizer step of DGPO's loss on the units `minibatch`, in micro-batches of whole units."""
    sums: Dict[str, torch.Tensor] = {}
    worker.zero_grad()
    chunks = minibatch.split(max(1, worker.cfg.trainer.micro_batch_size // data.batch.group_size))
    for i, units in enumerate(chunks):
        out = unit_loss(worker, data, baselines, units)
        weight = len(units) / len(minibatch)
        worker.backward(out["loss"] * weight, sync=i == len(chunks) - 1)
        for key, value in out.items():
            sums[key] = sums.get(key, 0.0) + value.detach().double() * weight
    grad_norm = worker.optimizer_step()
    metrics = {key: float(value) for key, value in sums.items()}
    return {**metrics, "grad_norm": grad_norm, "skipped_nonfinite": float(not math.isfinite(grad_norm))}


def update(worker, batch: GroupBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """DGPO's update on a worker holding groups [first, first + len(batch)) of `total`: the
    reference's errors (and, for the trust region, the policy's) first, without gradient, then
    `num_inner_epochs` passes of `num_minibatches` optimizer steps over the (group, noise
    level) units."""
    algo = worker.cfg.algorithm
    sigmas, noise = group_noise(algo, total or len(batch), batch.clean.shape[1:], seed, first, len(batch))
    data = Units(batch, sigmas, noise, algo.timesteps_per_group)
    old = None if algo.clip_range is None else unit_errors(worker, data, reference=False)
    baselines = Baselines(unit_errors(worker, data), old)
    generator = seeding.seeded_generator(seed, first, seeding.MINIBATCHES)
    totals: Dict[str, List[float]] = {}
    for _ in range(algo.num_inner_epochs):
        for minibatch in torch.randperm(len(data), generator=generator).tensor_split(algo.num_minibatches):
            for key, value in minibatch_step(worker, data, baselines, minibatch).items():
                totals.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


# ----------------------------------------------------------------- the step, on the driver
class DGPO(Algorithm):
    """prompts -> ODE rollout (no log-probs) -> reward -> group advantages -> group
    preference update of the LoRA against the reference -> weight sync."""

    Options = DGPOConfig  # its options: schema/algorithm/dgpo

    @classmethod
    def uses_reference(cls, cfg) -> bool:
        return True  # every implicit reward compares the policy's error with the reference's

    @classmethod
    def check_config(cls, cfg) -> None:
        algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
        check_groups(algo.group_size, trainer.batch_size)
        require(algo.beta > 0, f"algorithm.beta={algo.beta} must be positive")
        require(algo.adv_clip_max > 0, f"algorithm.adv_clip_max={algo.adv_clip_max} must be positive")
        clip = algo.clip_range
        require(clip is None or 0 < clip < 1, f"algorithm.clip_range={clip} must be in (0, 1), or null for none")
        require(algo.kl_coef >= 0, f"algorithm.kl_coef={algo.kl_coef} must be >= 0 (0: no KL)")
        require(algo.timesteps_per_group >= 1, f"algorithm.timesteps_per_group={algo.timesteps_per_group} must be >= 1")
        require(algo.num_inner_epochs >= 1, f"algorithm.num_inner_epochs={algo.num_inner_epochs} must be >= 1")
        prompts = trainer.batch_size // algo.group_size
        require(
            prompts % trainer.n_workers == 0,
            f"algorithm=dgpo trains whole groups on each worker: trainer.batch_size={trainer.batch_size} / "
            f"algorithm.group_size={algo.group_size} = {prompts} prompts do not split over trainer.n_workers="
            f"{trainer.n_workers}",
        )
        units = prompts // trainer.n_workers * algo.timesteps_per_group
        require(
            1 <= algo.num_minibatches <= units,
            f"algorithm.num_minibatches={algo.num_minibatches}: each worker's {units} (group, noise level) units "
            f"(prompts per worker x algorithm.timesteps_per_group) are shared out over the minibatches, "
            f"so expected 1 to {units}",
        )
        require(
            rollout.sde_type == SDEType.sde,
            f"rollout.sde_type={rollout.sde_type.value} with algorithm=dgpo: DGPO samples with the ODE and takes "
            "no stochastic step; leave rollout.sde_type at its default",
        )

    def step(self, step: int) -> Dict[str, float]:
        algo, worker = self.cfg.algorithm, self.ctx.worker
        rollout = grouped_rollout(self.ctx, step, algo.group_size, (0, 0))  # every step the ODE's
        advantages, advantage_metrics = rollout.advantages(algo.group_size, self.cfg.reward.aggregation, algo.adv_norm)
        advantages = clip_advantages(advantages, algo.adv_clip_max)  # an image without a finite reward: 0
        batch = GroupBatch(rollout.batch.latents[:, -1], rollout.batch.cond, advantages, algo.group_size)
        tick = time.perf_counter()
        metrics = worker.apply_update(update, batch, update_seed(self.cfg.seed, step))
        timings = {**rollout.timings, "time/update": time.perf_counter() - tick}
        timings.update(sync_engine(worker))
        train = {f"train/{k}": v for k, v in metrics.items()}
        return {**rollout.reward_metrics(), **advantage_metrics, **train, **timings}


ALGORITHM = DGPO
