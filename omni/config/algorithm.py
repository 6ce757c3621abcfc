"""Schemas of the `algorithm` group: one dataclass per algorithm family."""

from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

from omegaconf import MISSING


class SigmaSampling(str, Enum):
    logit_normal = "logit_normal"  # SD3's training distribution: sigmoid of a normal
    uniform = "uniform"


# How advantages are scaled once the group mean is subtracted: "group" divides by the group's
# std (GRPO), "global" by the whole batch's (Flow-GRPO's setting for real models), "none" not
# at all (Dr.GRPO, Liu et al. 2025). Built with the functional API: `global` is a keyword.
AdvantageNorm = Enum("AdvantageNorm", [(n, n) for n in ("group", "global", "none")], type=str)


class KLType(str, Enum):
    latent = "latent"  # Gaussian KL of the SDE steps (on their means): Flow-GRPO
    velocity = "velocity"  # mean squared distance of the predicted velocities


class CFGGradient(str, Enum):
    """Which passes of classifier-free guidance the update differentiates."""

    both = "both"  # the guided velocity's exact gradient
    # the conditional pass only, the unconditional one run apart without gradients, as
    # flow_grpo's trainers detach it: the backward covers half the batch (about a third less
    # update compute), and the gradient leaves out how the LoRA moves the unconditional velocity
    conditional = "conditional"


@dataclass
class AlgorithmConfig:
    # A name registered in omni/algorithms/ (omni.algorithms.ALGORITHMS).
    name: str = MISSING


@dataclass
class GroupPolicyConfig(AlgorithmConfig):
    """What every group-advantage, per-denoising-step policy algorithm shares."""

    # Images sampled per prompt; advantages are normalised within each group.
    group_size: int = 8
    adv_clip_max: float = 5.0
    # How advantages are scaled after subtracting the group mean (see AdvantageNorm).
    adv_norm: AdvantageNorm = AdvantageNorm["group"]
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


@dataclass
class MixGRPOConfig(FlowGRPOConfig):
    """MixGRPO: Flow-GRPO on a sliding SDE window (omni/algorithms/mix_grpo.py)."""

    sde_window_size: int = 4
    # The window moves this many denoising steps later every `shift_interval` training steps.
    window_stride: int = 1
    shift_interval: int = 10


@dataclass
class FlowDPPOConfig(GroupPolicyConfig):
    """Flow-DPPO: a trust region on the Gaussian KL of each step instead of ratio clipping."""

    # A transition whose KL(current step || rollout step), averaged over the latent, exceeds
    # this stops contributing once its ratio moves further in its advantage's direction.
    kl_mask_threshold: float = 1e-6


@dataclass
class DiffusionNFTConfig(AlgorithmConfig):
    """DiffusionNFT: forward-process training on ODE rollouts (omni/algorithms/diffusion_nft.py)."""

    group_size: int = 8
    adv_norm: AdvantageNorm = AdvantageNorm["group"]
    # Advantages are clipped to +-adv_clip_max, then mapped to optimality in [0, 1].
    adv_clip_max: float = 5.0
    # How far the implicit policies reach from the rollout policy.
    beta: float = 1.0
    # Noise levels drawn per clean latent, and how.
    timesteps_per_sample: int = 2
    sigma_sampling: SigmaSampling = SigmaSampling.uniform
    num_inner_epochs: int = 1
    num_minibatches: int = 2


@dataclass
class DPOConfig(AlgorithmConfig):
    # Strength of the pull towards the reference (Diffusion-DPO's beta).
    beta: float = 2500.0
    # How training noise levels are drawn.
    sigma_sampling: SigmaSampling = SigmaSampling.logit_normal
    logit_mean: float = 0.0
    logit_std: float = 1.0


@dataclass
class OnlineDPOConfig(DPOConfig):
    # Images sampled per prompt; its best and worst by reward form a pair.
    group_size: int = 8
