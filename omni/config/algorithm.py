"""The `algorithm` group's base schema and the option types algorithms share.

Each algorithm declares its own options beside its code (`Options` on its class in
`omni/algorithms/<name>.py`, a subclass of `AlgorithmConfig`), stored as
`schema/algorithm/<name>` by `omni.registration`."""

from dataclasses import dataclass
from enum import Enum

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
class GroupAdvantageConfig(AlgorithmConfig):
    """What every algorithm that samples a group per prompt and trains on group advantages shares."""

    # Images sampled per prompt; advantages are normalised within each group.
    group_size: int = 8
    # How advantages are scaled after subtracting the group mean (see AdvantageNorm).
    adv_norm: AdvantageNorm = AdvantageNorm["group"]
    # Advantages are clipped to +-adv_clip_max (each algorithm says how it then reads them).
    adv_clip_max: float = 5.0
