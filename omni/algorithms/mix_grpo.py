"""MixGRPO (Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE",
arXiv:2507.21802): Flow-GRPO whose rollouts take SDE steps only inside a window of
`sde_window_size` denoising steps, ODE steps elsewhere, and whose update trains only the
window's steps. Unlike Flow-GRPO-Fast's randomly placed window, MixGRPO's slides: it starts
at the first (noisiest) step and moves `window_stride` steps later every `shift_interval`
training steps, until it reaches the last stochastic step, where it stays. High-noise steps,
where most of the image is decided, are optimised first.

    start(step) = min((step // shift_interval) * window_stride, stochastic steps - sde_window_size)

MixGRPO-Flash, the paper's faster variant, takes the ODE steps outside the window with a
higher-order solver: here `rollout.ode_solver=dpm2`, DPM-Solver++(2M) (Lu et al. 2022,
arXiv:2211.01095; the formula is in omni/rollout/ode.py), and `algorithm=mix_grpo_flash` is
this algorithm with that solver. The window's SDE steps, their log-probs and the update are
the same; the ODE steps carry no log-prob and are not trained.

    python recipes/train.py algorithm=mix_grpo
    python recipes/train.py algorithm=mix_grpo_flash   # = algorithm=mix_grpo rollout.ode_solver=dpm2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from omni.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from omni.config.errors import require
from omni.rollout.sde import noisy_steps


def sliding_window(step: int, size: int, stride: int, shift_interval: int, available: int) -> Tuple[int, int]:
    """The SDE steps [start, stop) of training step `step`."""
    start = min((step // shift_interval) * stride, available - size)
    return start, start + size


@dataclass
class MixGRPOConfig(FlowGRPOConfig):
    """MixGRPO: Flow-GRPO on a sliding SDE window."""

    sde_window_size: int = 4
    # The window moves this many denoising steps later every `shift_interval` training steps.
    window_stride: int = 1
    shift_interval: int = 10


class MixGRPO(FlowGRPO):
    """Flow-GRPO's step and update on a sliding SDE window."""

    Options = MixGRPOConfig  # its options: schema/algorithm/mix_grpo

    @classmethod
    def check_config(cls, cfg) -> None:
        algo = cfg.algorithm
        require(
            algo.sde_window_size >= 1,
            f"algorithm.sde_window_size={algo.sde_window_size}: MixGRPO needs a window of at least 1 step",
        )
        require(
            algo.sde_window_range is None,
            "algorithm.sde_window_range: MixGRPO's window slides on its own; leave it null",
        )
        require(algo.window_stride >= 1, f"algorithm.window_stride={algo.window_stride} must be >= 1")
        require(algo.shift_interval >= 1, f"algorithm.shift_interval={algo.shift_interval} must be >= 1")
        super().check_config(cfg)  # the window fits the steps, the minibatches the window

    def window(self, step: int) -> Tuple[int, int]:
        algo = self.cfg.algorithm
        return sliding_window(
            step, algo.sde_window_size, algo.window_stride, algo.shift_interval, noisy_steps(self.cfg.rollout)
        )


ALGORITHM = MixGRPO
