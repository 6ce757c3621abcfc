"""GARDO (He et al. 2025, "GARDO: Reinforcing Diffusion Models without Reward Hacking",
arXiv:2512.24138): Flow-GRPO with three guards against reward hacking, each an option.

(a) Gated KL. A KL to the reference everywhere slows learning and ties the policy to a weak
base; reward hacking happens on few samples, those the trained (proxy) reward scores
unreliably. Only a fraction f (`gate_fraction`) of the batch, the most uncertain samples, pay
the KL; it is averaged over them:

    loss = Flow-GRPO's clipped loss + kl_coef x mean over gated samples of KL(policy || reference)

implemented as per-sample KL weights g_i = B / n_gated on the gated samples, 0 elsewhere
(`GRPOBatch.kl_weights`); f = 1 is Flow-GRPO's KL. The paper's uncertainty (`gate_by=
disagreement`) is how much more the proxy likes a sample than auxiliary rewards do: with win
rates over the batch, wr(i) = the share of the other samples that i out-scores,

    u_i = wr_proxy(i) - mean over auxiliaries k of wr_k(i)

with the proxy the trained reward and the auxiliaries the reward components `gate_rewards`
(scored, and trained on with their weight, 0 for none). The f B samples of largest u are
gated. Offline, with a single reward, `gate_by=advantage` gates the f B samples of largest
advantage: those the update pushes hardest towards, where a hacked proxy does most harm.

With `gate_schedule=adaptive` (the public code's) the fraction follows the uncertainty's
trend instead, and only samples with u >= 0 may be gated (with `gate_by=advantage`, u is the
advantage). With m_t the mean of u over this batch's valid samples with u >= 0, H the last
`gate_window` such means (before this one), and f_0 = gate_fraction,

    f_t = clip(f_{t-1} x (1 + gate_rate)   if m_t > max H
               f_{t-1} x (1 - gate_rate)   if m_t < min H
               f_{t-1}                      otherwise (or H empty),   gate_fraction_range)

and the ceil(f_t x n) samples of largest u among the n valid ones with u >= 0 are gated (f_t
is logged as `train/gate_fraction`). A batch without such a sample gates none and leaves f
and H alone. The public code's settings are the defaults: f in [0.02, 0.2], rate 0.1, a
window of 20, f_0 = 0.1. It gates the samples strictly above the (1 - f_t) quantile of the
n, a few fewer where u ties; and it measures u with ranks (1 the best), rank_proxy - mean
rank_aux, about (n - 1) times the win-rate difference above but of the opposite sign, so its
gated samples are those the proxy ranks below the auxiliaries. Here u keeps the sign above
(the proxy's excess liking); the difference is not settled.

(b) Adaptive reference. A reference the policy has long outgrown only holds it back, so it
is reset to the current policy every `reset_every` steps, and, with `reset_kl_threshold`,
after a step whose gated KL exceeded it. The reference is normally the transformer with its
LoRA disabled, which cannot move; with resets on, the worker keeps a second, frozen LoRA
adapter (`REFERENCE_SNAPSHOT`, see omni/workers/actor_rollout.py) that is the reference: it
starts as the untrained adapter (B = 0: exactly the base) and a reset loads the policy's LoRA
into it (`worker.load_snapshot`), so right after a reset the KL is 0. The adapter costs a
LoRA's memory, shards with the trained one under FSDP, and is loaded through the same
state-dict path as any LoRA; a merged copy of the transformer would cost a transformer.

(c) Diversity-aware advantages. Against mode collapse, a good sample's advantage grows with
how far it lies from the rest of its group. With phi an image feature (`diversity_feature`:
the image downsampled to 8 x 8 pixels, or an 8-bin colour histogram per channel: both run
offline; the paper uses DINOv3 embeddings) and d_i = min over the group's other samples j of
|phi_i - phi_j| (the nearest neighbour's distance),

    A_i <- A_i x d_i / mean of d over the group     where A_i > 0 (others unchanged)

before the clip to +-adv_clip_max. A negative advantage is never scaled: diversity is only
rewarded in samples already better than their group.

    python recipes/train.py algorithm=gardo
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from omni.algorithms.advantages import clip_advantages
from omni.algorithms.base import ScoredRollout
from omni.algorithms.flow_grpo import (
    FlowGRPO,
    FlowGRPOConfig,
    GRPOBatch,
    check_policy_config,
)
from omni.config.errors import require
from omni.weights import REFERENCE_SNAPSHOT

PIXELS = 8  # the pixel feature's side
BINS = 8  # the histogram feature's bins per channel


class GateSignal(str, Enum):
    disagreement = "disagreement"  # the proxy's win rate above the auxiliary rewards' (the paper's)
    advantage = "advantage"  # the largest advantages (needs no second reward)


class GateSchedule(str, Enum):
    fixed = "fixed"  # gate_fraction of the valid samples, every step
    adaptive = "adaptive"  # the fraction follows the uncertainty's trend; only u >= 0 is gated


class DiversityFeature(str, Enum):
    none = "none"  # no diversity bonus
    pixels = "pixels"  # the image downsampled to 8 x 8
    histogram = "histogram"  # 8-bin colour histogram per channel


@dataclass
class GARDOConfig(FlowGRPOConfig):
    """GARDO: Flow-GRPO with a gated KL, a reference that is reset, and diversity-aware advantages."""

    # The KL's weight (GARDO's SD3 OCR setting); it applies to the gated samples only.
    kl_coef: float = 0.04
    # The fraction of the batch that pays the KL (1: every sample, Flow-GRPO's KL; 0: none).
    gate_fraction: float = 0.1
    gate_by: GateSignal = GateSignal.advantage
    # gate_by=disagreement: the reward components the trained reward is compared with.
    gate_rewards: List[str] = field(default_factory=list)
    gate_schedule: GateSchedule = GateSchedule.fixed
    # gate_schedule=adaptive: the fraction's bounds [lo, hi], its relative step, and how many
    # past steps' mean uncertainties it is compared with (the public code's settings).
    gate_fraction_range: List[float] = field(default_factory=lambda: [0.02, 0.2])
    gate_rate: float = 0.1
    gate_window: int = 20
    # Reset the reference to the policy every this many steps (0: never) ...
    reset_every: int = 15
    # ... and after a step whose gated KL exceeded this (null: no such reset).
    reset_kl_threshold: Optional[float] = None
    diversity_feature: DiversityFeature = DiversityFeature.pixels


# ----------------------------------------------------------------- the gate, on tensors
def win_rates(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per sample, the share of the batch's other valid samples whose score it beats (a tie
    counts half); 0 for an invalid sample."""
    n = int(valid.sum())
    s = scores.float()
    beats = (s[:, None] > s[None, :]).float() + 0.5 * (s[:, None] == s[None, :]).float()
    beats = beats * valid[None, :]
    rates = (beats.sum(dim=1) - 0.5) / max(n - 1, 1)  # less the tie with itself
    return torch.where(valid, rates, torch.zeros(()))


def disagreement(proxy: torch.Tensor, auxiliaries: List[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """u = win rate under the proxy - mean of the win rates under the auxiliary rewards."""
    aux = torch.stack([win_rates(a, valid) for a in auxiliaries]).mean(dim=0)
    return win_rates(proxy, valid) - aux


def gate_weights(signal: torch.Tensor, valid: torch.Tensor, fraction: float) -> torch.Tensor:
    """KL weights: B / n on the n = ceil(fraction x eligible) samples of largest `signal` among
    the `valid` (eligible) ones, 0 elsewhere, so that a mean over the batch is the mean over
    the gated samples."""
    n = math.ceil(fraction * int(valid.sum()) - 1e-9)
    weights = torch.zeros(len(signal))
    if n == 0:
        return weights
    ranked = torch.where(valid, signal.float(), torch.full((), -math.inf))
    weights[torch.topk(ranked, n).indices] = len(signal) / n
    return weights


@dataclass
class AdaptiveGate:
    """The adaptive schedule's state: the gated fraction and the past steps' mean uncertainties."""

    fraction: float
    rate: float
    bounds: Tuple[float, float]
    window: int
    history: List[float] = field(default_factory=list)

    def weights(self, signal: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Moves the fraction by this batch's mean non-negative signal, then gates that fraction
        of the valid samples with signal >= 0 (`gate_weights`)."""
        eligible = valid & (signal >= 0)
        if eligible.any():
            self.update(float(signal[eligible].mean()))
        return gate_weights(signal, eligible, self.fraction)

    def update(self, level: float) -> None:
        if self.history and level > max(self.history):
            self.fraction *= 1 + self.rate
        elif self.history and level < min(self.history):
            self.fraction *= 1 - self.rate
        self.fraction = min(max(self.fraction, self.bounds[0]), self.bounds[1])
        self.history = (self.history + [level])[-self.window :]


# ----------------------------------------------------------------- the diversity bonus
def image_features(images: torch.Tensor, feature: str) -> torch.Tensor:
    """(B, D) features of images (B, 3, H, W) or clips (B, F, 3, H, W) in [0, 1]."""
    frames = images.reshape(len(images), -1, *images.shape[-3:]).float()
    flat = frames.reshape(-1, *images.shape[-3:])
    if DiversityFeature(feature) == DiversityFeature.pixels:
        return F.adaptive_avg_pool2d(flat, PIXELS).reshape(len(images), -1)
    bins = (flat.clamp(0, 1) * BINS).long().clamp(max=BINS - 1)  # (N, 3, H, W)
    counts = F.one_hot(bins, BINS).float().mean(dim=(2, 3))  # (N, 3, BINS): each channel's histogram
    return counts.reshape(len(images), -1)


def nearest_distances(features: torch.Tensor, group_size: int, valid: torch.Tensor) -> torch.Tensor:
    """Per sample, the distance to the nearest other valid sample of its group (0 when it has none)."""
    grouped = features.reshape(-1, group_size, features.shape[-1])
    ok = valid.reshape(-1, group_size)
    distances = torch.cdist(grouped, grouped)
    usable = ok[:, None, :] & ok[:, :, None] & ~torch.eye(group_size, dtype=torch.bool)
    nearest = torch.where(usable, distances, torch.full((), math.inf)).min(dim=2).values
    return torch.where(torch.isfinite(nearest) & ok, nearest, torch.zeros(())).reshape(-1)


def diversity_bonus(
    advantages: torch.Tensor, distances: torch.Tensor, group_size: int, valid: torch.Tensor
) -> torch.Tensor:
    """A_i x d_i / (mean of d over the group's valid samples) where A_i > 0; the rest unchanged
    (as is a group whose samples all coincide)."""
    d, ok = distances.reshape(-1, group_size), valid.reshape(-1, group_size)
    mean = (d * ok).sum(dim=1, keepdim=True) / ok.sum(dim=1, keepdim=True).clamp(min=1)
    scale = torch.where(mean > 0, d / mean.clamp(min=1e-12), torch.ones(()))
    return torch.where(advantages.reshape(-1, group_size) > 0, advantages.reshape(-1, group_size) * scale,
                       advantages.reshape(-1, group_size)).reshape(-1)  # fmt: skip


# ----------------------------------------------------------------- the step, on the driver
class GARDO(FlowGRPO):
    """Flow-GRPO's rollout and update; the advantages get the diversity bonus, the KL the
    gate, and the reference is reset to the policy between steps."""

    Options = GARDOConfig  # its options: schema/algorithm/gardo
    supports_async = False  # it resets the reference to the policy between rollout and update

    def __init__(self, ctx):
        super().__init__(ctx)
        self.last_reset = 0  # the step the reference last became the policy (0: the base)
        self.last_kl: Optional[float] = None  # the previous step's gated KL
        self.reference: Optional[Dict[str, torch.Tensor]] = None  # the reference LoRA since a reset
        self.gate = self.adaptive_gate(ctx.cfg.algorithm)  # None: the fixed fraction

    @staticmethod
    def adaptive_gate(algo) -> Optional[AdaptiveGate]:
        if GateSchedule(algo.gate_schedule) != GateSchedule.adaptive:
            return None
        lo, hi = algo.gate_fraction_range
        return AdaptiveGate(algo.gate_fraction, algo.gate_rate, (lo, hi), algo.gate_window)

    @classmethod
    def check_config(cls, cfg) -> None:
        algo = cfg.algorithm
        require(algo.clip_range > 0, f"algorithm.clip_range={algo.clip_range} must be positive")
        require(0 <= algo.gate_fraction <= 1, f"algorithm.gate_fraction={algo.gate_fraction} must be in [0, 1]")
        bounds = list(algo.gate_fraction_range)
        require(
            len(bounds) == 2 and 0 <= bounds[0] <= bounds[1] <= 1,
            f"algorithm.gate_fraction_range={bounds} must be [lo, hi] with 0 <= lo <= hi <= 1",
        )
        require(0 < algo.gate_rate < 1, f"algorithm.gate_rate={algo.gate_rate} must be in (0, 1)")
        require(algo.gate_window >= 1, f"algorithm.gate_window={algo.gate_window} must be >= 1")
        require(algo.reset_every >= 0, f"algorithm.reset_every={algo.reset_every} must be >= 0 (0: never)")
        threshold = algo.reset_kl_threshold
        require(threshold is None or threshold > 0, f"algorithm.reset_kl_threshold={threshold} must be positive")
        if GateSignal(algo.gate_by) == GateSignal.disagreement:
            names = list(cfg.reward.components)
            require(
                bool(algo.gate_rewards) and all(name in names for name in algo.gate_rewards),
                f"algorithm.gate_rewards={list(algo.gate_rewards)} with algorithm.gate_by=disagreement: name the "
                f"auxiliary rewards among reward.components ({', '.join(names)}; weight 0 scores without training)",
            )
        require(
            not cls.resets(cfg) or cfg.model.lora is not None,
            f"algorithm.reset_every={algo.reset_every} with model.lora=null: the reset reference is a second LoRA "
            "adapter; set algorithm.reset_every=0 (and leave algorithm.reset_kl_threshold=null) for full fine-tuning",
        )
        check_policy_config(cfg)

    @classmethod
    def resets(cls, cfg) -> bool:
        algo = cfg.algorithm
        return algo.kl_coef > 0 and (algo.reset_every > 0 or algo.reset_kl_threshold is not None)

    @classmethod
    def snapshot_adapters(cls, cfg) -> Tuple[str, ...]:
        return (REFERENCE_SNAPSHOT,) if cls.resets(cfg) else ()

    def update_batch(self, rollout: ScoredRollout) -> Tuple[GRPOBatch, Dict[str, float]]:
        algo, valid = self.cfg.algorithm, rollout.valid
        advantages, metrics = rollout.advantages(algo.group_size, self.cfg.reward.aggregation, algo.adv_norm)
        raw = clip_advantages(advantages, algo.adv_clip_max)
        if DiversityFeature(algo.diversity_feature) != DiversityFeature.none:
            features = image_features(rollout.batch.images, algo.diversity_feature)
            distances = nearest_distances(features, algo.group_size, valid)
            advantages = diversity_bonus(advantages, distances, algo.group_size, valid)
            metrics["diversity_distance"] = float(distances[valid].mean())
        advantages = clip_advantages(advantages, algo.adv_clip_max)
        metrics["diversity_shift"] = float((advantages - raw).abs()[valid].mean())
        weights = self.kl_weights(rollout, advantages, metrics)
        return GRPOBatch(rollout.batch, advantages, weights), metrics

    def kl_weights(self, rollout: ScoredRollout, advantages: torch.Tensor, metrics: Dict[str, float]) -> torch.Tensor:
        """The batch's KL weights: its gated samples by the configured signal and schedule."""
        algo, valid = self.cfg.algorithm, rollout.valid
        if GateSignal(algo.gate_by) == GateSignal.disagreement:
            auxiliaries = [rollout.scores[name] for name in algo.gate_rewards]
            signal = disagreement(rollout.scores["reward"], auxiliaries, valid)
            metrics["uncertainty"] = float(signal[valid].mean())
        else:
            signal = advantages
        if self.gate is None:
            weights = gate_weights(signal, valid, algo.gate_fraction)
        else:
            weights = self.gate.weights(signal, valid)
            metrics["gate_fraction"] = self.gate.fraction
        metrics["gated_fraction"] = float((weights > 0).float().mean())
        return weights

    def reset_due(self, step: int) -> bool:
        algo = self.cfg.algorithm
        if step == 0 or not self.resets(self.cfg):
            return False
        periodic = algo.reset_every > 0 and step - self.last_reset >= algo.reset_every
        drifted = algo.reset_kl_threshold is not None and (self.last_kl or 0.0) > algo.reset_kl_threshold
        return periodic or drifted

    def reset_reference(self, step: int) -> None:
        """The reference becomes the policy as it is now."""
        self.reference = self.ctx.worker.lora_state_dict()
        self.ctx.worker.load_snapshot(REFERENCE_SNAPSHOT, self.reference)
        self.last_reset = step

    def step(self, step: int) -> Dict[str, float]:
        reset = self.reset_due(step)
        if reset:
            self.reset_reference(step)
        metrics = super().step(step)
        self.last_kl = metrics.get("train/kl_weighted")
        return {**metrics, "train/reference_reset": float(reset), "train/reference_age": float(step - self.last_reset)}

    def state_dict(self) -> Dict[str, object]:
        gate = None if self.gate is None else {"fraction": self.gate.fraction, "history": list(self.gate.history)}
        return {"last_reset": self.last_reset, "last_kl": self.last_kl, "reference": self.reference, "gate": gate}

    def load_state_dict(self, state: Dict[str, object], step: int) -> None:
        """The checkpoint's reference (the base before any reset), reset clock and adaptive gate."""
        self.last_reset, self.last_kl = state.get("last_reset", 0), state.get("last_kl")
        self.gate = self.adaptive_gate(self.cfg.algorithm)
        if self.gate is not None and state.get("gate"):
            self.gate.fraction, self.gate.history = state["gate"]["fraction"], list(state["gate"]["history"])
        self.reference = state.get("reference")
        if self.resets(self.cfg):
            base = self.reference is None
            lora = self.ctx.worker.lora_state_dict()
            reference = {n: torch.zeros_like(t) if base and ".lora_B." in n else t for n, t in lora.items()}
            self.ctx.worker.load_snapshot(REFERENCE_SNAPSHOT, reference if base else self.reference)


ALGORITHM = GARDO
