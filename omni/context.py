"""What an algorithm's training step works with: `StepContext`, built by the trainer.

A step gets the typed config, the model family, the prompt sets, the reward, the
actor-rollout worker (one in this process, or a Ray group with the same methods) and the
logger; never the trainer. Everything random in a step is a function of (seed, step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from omni import seeding
from omni.rewards.streaming import StreamedScores
from omni.rollout.base import RolloutBatch, SamplingOptions, run_sampling_options
from omni.rollout.sde import noisy_steps, sde_window

if TYPE_CHECKING:
    from omni.workers.protocol import ActorRollout


def step_seeds(seed: int, step: int, n: int) -> List[int]:
    """`n` image seeds of training step `step` (or of the evaluation, with its own seed)."""
    generator = seeding.seeded_generator(seed, step, seeding.STEP_IMAGES)
    return torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()


def update_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s update (minibatch shuffles, DPO noise)."""
    return seeding.derive_seed(seed, step, seeding.UPDATE)


def means(scores: Dict[str, torch.Tensor], prefix: str) -> Dict[str, float]:
    return {f"{prefix}{k}": float(v.mean()) for k, v in scores.items()}


@dataclass
class StepContext:
    cfg: Any  # omni.config.TrainConfig
    family: Any  # omni.models.base.ModelFamily
    train_prompts: List[str]
    eval_prompts: List[str]
    reward: Any  # omni.rewards.WeightedReward
    worker: Optional[ActorRollout] = None  # set once built: ActorRolloutWorker or ActorRolloutGroup
    logger: Any = None  # omni.loggers.MetricsLogger

    def sampling_options(self, sde_steps: Tuple[int, int] = (0, 0)) -> SamplingOptions:
        """Sampling with SDE steps [start, stop); the default (0, 0) is the deterministic ODE
        sampling of evaluation."""
        return run_sampling_options(self.cfg, sde_steps)

    def sample_and_score(
        self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions
    ) -> Tuple[RolloutBatch, Dict[str, torch.Tensor], Dict[str, float]]:
        """Sample the images of (prompt, seed) and score them: the batch, the scores ("reward"
        and each component) and timings (time/rollout: sampling; time/reward: scoring;
        time/reward_wait: how long the scores were waited for after sampling).

        The reward scores the rollout in parts of `rollout.micro_batch_size` images per
        worker. With `reward.overlap`, the parts are sampled in turn and each is scored while
        the next is sampled; without, the whole rollout is sampled, then scored. Either way
        the images are the same (each has its own seed) and so are the scores."""
        cfg, tick = self.cfg, time.perf_counter()
        part = cfg.rollout.micro_batch_size * cfg.trainer.n_workers
        if not cfg.reward.overlap or len(prompts) <= part:
            batch = self.worker.generate(prompts, seeds, options)
            sampled = time.perf_counter()
            scores = self.reward(batch.images, prompts, part)
            done = time.perf_counter()
            return (
                batch,
                scores,
                {"time/rollout": sampled - tick, "time/reward": done - sampled, "time/reward_wait": done - sampled},
            )
        parts = []
        with StreamedScores(self.reward, len(prompts)) as stream:
            for start in range(0, len(prompts), part):
                parts.append(self.worker.generate(prompts[start : start + part], seeds[start : start + part], options))
                stream.add(parts[-1].images, prompts[start : start + part])
            sampled = time.perf_counter()
            scores = stream.result()
        done = time.perf_counter()
        return (
            RolloutBatch.cat(parts),
            scores,
            {"time/rollout": sampled - tick, "time/reward": stream.busy_s, "time/reward_wait": done - sampled},
        )

    def sde_window(self, step: int, size: int = 0, allowed: Optional[Sequence[int]] = None) -> Tuple[int, int]:
        """Step `step`'s SDE steps: all of them (size 0), or a window of `size` whose start
        is drawn from `allowed` (Flow-GRPO-Fast)."""
        generator = seeding.seeded_generator(self.cfg.seed, step, seeding.SDE_WINDOW)
        return sde_window(noisy_steps(self.cfg.rollout), size, allowed, generator)

    def log_images(self, images: torch.Tensor, step: int) -> None:
        every = self.cfg.logger.image_every
        if self.logger is not None and every and step % every == 0:
            self.logger.log_images(images, step)
