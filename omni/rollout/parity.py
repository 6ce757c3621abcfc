"""The parity gate: after a weight sync, the actor re-scores a probe the engine just sampled.

An engine that keeps its own copy of the transformer (`rollout.share_actor=false`, or
`rollout=vllm` with either backend) samples the policy the actor trains only if each weight
sync reached it whole. An engine that dropped a LoRA tensor, kept a stale adapter or loaded
one at another scale samples another policy, and every update's importance ratios silently
start away from 1. After the syncs `rollout.parity` picks (the first two, then every
`every`-th), the gate

1. compares, by name, the modules the engine reports its LoRA adapter bound
   (`engine.lora_modules`; None, as the vLLM `native` backend answers: not compared) with
   those the actor trains (the names of the LoRA tensors the sync sent);
2. has the engine sample a probe of `images` images (fixed prompts, seeds that change with
   each check, the run's sampling options with every noisy step stochastic), which the actor
   re-scores step by step (`rescore_log_probs`, in eval mode: what an update starts from);
3. compares the two log-probs of each SDE step: mean |ratio - 1| against
   `max_mean_ratio_deviation`, the largest |log-prob difference| against `max_log_prob_diff`.

A failure raises `ParityError` naming the sync, the engine and what differs (the missing
modules, or each figure against its tolerance and where the largest difference is); the
trainer's message adds the step. Each check's figures are returned (`sync/parity_*`, logged
with the step whose sync ran it) and written to the log.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Sequence

import torch

from omni.models.base import ModelFamily
from omni.rollout import engine_name
from omni.rollout.base import RolloutBatch, SamplingOptions, run_sampling_options
from omni.rollout.engine_client import EngineError
from omni.rollout.sampling import rescore_log_probs
from omni.rollout.sde import noisy_steps

logger = logging.getLogger(__name__)

PROBE_PROMPTS = ("a red apple", "a blue dog", "a green tree", "a white house")  # short: any text length fits
# The native backend runs vLLM-Omni's kernels, not the actor's: figures near its noise floor
# may be that floor (rollout.parity in omni/config/rollout.py).
NATIVE_HINT = (
    "; or these figures are the noise of the native backend's own kernels (in bf16 ~1e-4 on the tiny SD3): "
    "then raise rollout.parity.max_mean_ratio_deviation and max_log_prob_diff, knowing the ratios start that "
    "far from 1"
)
MODULES_NAMED = 10  # missing modules an error lists by name (then how many more)


class ParityError(EngineError):
    """The engine samples another policy than the actor trains (the parity gate failed)."""


def engine_label(cfg) -> str:
    """The engine as its keys name it."""
    label = f"rollout.engine={engine_name(cfg)}"
    backend = getattr(getattr(cfg.rollout, "options", None), "backend", None)
    if backend is not None:
        label += f", rollout.options.backend={getattr(backend, 'value', backend)}"
    return label if backend is not None else f"{label}, rollout.share_actor=false"


class ParityGate:
    def __init__(self, options, sampling: SamplingOptions, engine: str):
        """`options`: `rollout.parity` (omni.config.rollout.ParityConfig); `sampling`: the
        probe's; `engine`: how messages name the engine."""
        self.options, self.sampling, self.engine = options, sampling, engine

    @classmethod
    def of_run(cls, cfg) -> Optional["ParityGate"]:
        """The run's gate; None with `rollout.parity.every=0`."""
        if cfg.rollout.parity.every == 0:
            return None
        sampling = run_sampling_options(cfg, (0, noisy_steps(cfg.rollout)))
        return cls(cfg.rollout.parity, sampling, engine_label(cfg))

    def due(self, sync: int) -> bool:
        """Whether sync number `sync` (from 1) is checked."""
        return sync <= 2 or sync % self.options.every == 0

    def check(
        self,
        sync: int,
        family: ModelFamily,
        actor: torch.nn.Module,
        dtype: torch.dtype,
        engine,
        trained_modules: Optional[Sequence[str]],
    ) -> Dict[str, float]:
        """Check sync number `sync`: the figures, or `ParityError`. `trained_modules`: the
        modules the actor's LoRA trains (None with full fine-tuning)."""
        start = time.perf_counter()
        figures: Dict[str, float] = {}
        bound = getattr(engine, "lora_modules", None)
        if trained_modules is not None and bound is not None:
            missing = sorted(set(trained_modules) - set(bound))
            figures["sync/parity_missing_modules"] = float(len(missing))
            if missing:
                raise ParityError(self._missing_message(sync, missing, len(trained_modules)))
        n = self.options.images
        prompts = [PROBE_PROMPTS[i % len(PROBE_PROMPTS)] for i in range(n)]
        probe = engine.generate(prompts, [sync * n + i for i in range(n)], self.sampling)
        rescored = rescored_in_eval_mode(family, actor, probe, dtype)
        figures.update(compare(rescored, probe))
        figures["sync/parity_seconds"] = time.perf_counter() - start
        logger.info(
            "parity gate, sync %d (%s): mean |ratio - 1| %.3g, largest |log-prob difference| %.3g, %.2f s",
            sync,
            self.engine,
            figures["sync/parity_mean_ratio_dev"],
            figures["sync/parity_max_log_prob_diff"],
            figures["sync/parity_seconds"],
        )
        failed = self._over_tolerance(figures)
        if failed:
            raise ParityError(self._figures_message(sync, failed, rescored, probe))
        return figures

    def _over_tolerance(self, figures: Dict[str, float]) -> List[str]:
        options = self.options
        checks = (
            ("mean |ratio - 1|", figures["sync/parity_mean_ratio_dev"], "max_mean_ratio_deviation"),
            ("largest |log-prob difference|", figures["sync/parity_max_log_prob_diff"], "max_log_prob_diff"),
        )
        return [
            f"{what} {value:.3g} > rollout.parity.{key}={getattr(options, key):g}"
            for what, value, key in checks
            if not value <= getattr(options, key)  # a NaN fails too
        ]

    def _where(self, sync: int) -> str:
        return f"parity gate after weight sync {sync} to the rollout engine ({self.engine})"

    def _missing_message(self, sync: int, missing: List[str], trained: int) -> str:
        named = ", ".join(missing[:MODULES_NAMED]) + (
            f" (and {len(missing) - MODULES_NAMED} more)" if len(missing) > MODULES_NAMED else ""
        )
        return (
            f"{self._where(sync)}: its LoRA adapter is bound to {trained - len(missing)} of the {trained} modules "
            f"the actor trains; missing: {named}"
        )

    def _figures_message(self, sync: int, failed: List[str], rescored: torch.Tensor, probe: RolloutBatch) -> str:
        start, stop = probe.options.sde_steps
        diff = (rescored - probe.log_probs)[:, start:stop].abs().nan_to_num(float("inf"))
        image, step = divmod(int(diff.argmax()), stop - start)
        return (
            f"{self._where(sync)}: the actor's re-scoring of the engine's probe ({len(probe)} images, SDE steps "
            f"{start}..{stop - 1}) differs: {'; '.join(failed)} (largest at image {image}, step {start + step}). "
            "The engine samples another policy than the actor trains: a LoRA tensor it did not load, an adapter "
            "it did not replace, or one at another scale" + (NATIVE_HINT if "backend=native" in self.engine else "")
        )


def rescored_in_eval_mode(family: ModelFamily, actor: torch.nn.Module, batch: RolloutBatch, dtype) -> torch.Tensor:
    """The actor's log-probs of the batch's SDE steps, in eval mode (then its mode restored)."""
    training = actor.training
    actor.eval()
    try:
        return rescore_log_probs(family, actor, batch, dtype)
    finally:
        actor.train(training)


def compare(rescored: torch.Tensor, batch: RolloutBatch) -> Dict[str, float]:
    """The figures of the actor's log-probs against the engine's on the SDE steps."""
    start, stop = batch.options.sde_steps
    diff = (rescored - batch.log_probs)[:, start:stop]
    return {
        "sync/parity_mean_ratio_dev": float(diff.exp().sub(1).abs().mean()),
        "sync/parity_max_log_prob_diff": float(diff.abs().max()),
    }
