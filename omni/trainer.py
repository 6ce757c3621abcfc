"""The training loop (one driver process): set-up, the algorithm's steps (`omni.steps`),
evaluation on held-out prompts and seeds, logging and checkpoints.

Everything random is a function of (seed, step): the prompts of a step, the seeds of its
images, the SDE window and the update's shuffling. A resumed run therefore needs only the
step, the LoRA and the optimizer state to continue exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from omni import checkpoint
from omni.config.validate import validate
from omni.data.prompts import load_prompts
from omni.loggers import MetricsLogger
from omni.models.sd3 import tiny_sd3_path
from omni.rewards import WeightedReward
from omni.steps import build_step
from omni.workers import WorkerFailure, build_actor_rollout
from omni.rollout.base import SamplingOptions
from omni.rollout.sde import sde_window


def model_path(model: DictConfig) -> str:
    """The checkpoint directory to load: the cached tiny model, built on first use, or model.path."""
    if model.tiny_seed is not None:
        return str(tiny_sd3_path(model.cache_dir, model.tiny_seed))
    return str(Path(model.path).expanduser())


def step_seeds(seed: int, step: int, n: int) -> List[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()


class Trainer:
    """Set-up, the step loop, evaluation and checkpoints; the algorithm's step is `step_fn`."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.train_prompts = load_prompts(cfg.data.train, "data.train")
        self.eval_prompts = load_prompts(cfg.data.eval, "data.eval") if cfg.data.eval else self.train_prompts
        self.reward_fn = WeightedReward(cfg.reward.weights, cfg.reward.batch_size)
        self.step_fn = build_step(self)  # reads the algorithm's data before any model loads
        self.start_step = 0
        self.worker = self.logger = None
        self.position = "set-up"  # where the loop is, for a worker failure's message

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.worker = build_actor_rollout(self.cfg, model_path(self.cfg.model))
        if hasattr(self.step_fn, "setup"):
            self.step_fn.setup()
        self.logger = MetricsLogger(self.cfg, self.output_dir)
        resume = self._resume_dir()
        if resume is not None:
            self.load_checkpoint(resume)

    def _resume_dir(self) -> Optional[Path]:
        resume = self.cfg.trainer.resume
        if resume == "auto":
            return checkpoint.latest_checkpoint(self.checkpoint_dir)
        return Path(resume) if resume else None

    # ----------------------------------------------------------------- sampling
    def sampling_options(self, step: Optional[int]) -> SamplingOptions:
        """SDE options of a training step, or deterministic ODE sampling (step None) for eval."""
        rollout, algo = self.cfg.rollout, self.cfg.algorithm
        if step is None:
            window = (0, 0)
        else:
            generator = torch.Generator().manual_seed(self.cfg.seed * 7_919 + step)
            window_size, window_range = algo.get("sde_window_size", 0), algo.get("sde_window_range")
            window = sde_window(rollout.num_steps, window_size, window_range, generator)
        return SamplingOptions(
            num_steps=rollout.num_steps,
            resolution=rollout.resolution,
            guidance_scale=rollout.guidance_scale,
            noise_level=rollout.noise_level,
            max_sequence_length=self.cfg.model.max_sequence_length,
            sde_steps=window,
        )

    def eval_metrics(self, scores: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Mean held-out rewards, plus what the algorithm's step measures on held-out data."""
        extra = getattr(self.step_fn, "evaluate", None)
        return {**self.means(scores, "eval/"), **(extra() if extra else {})}

    def evaluate(self) -> Dict[str, torch.Tensor]:
        """Rewards of ODE samples on the held-out prompts and seeds, one per image."""
        n = self.cfg.trainer.eval_images_per_prompt
        prompts = [p for p in self.eval_prompts for _ in range(n)]
        seeds = step_seeds(self.cfg.trainer.eval_seed, 0, len(prompts))
        batch = self.worker.generate(prompts, seeds, self.sampling_options(None))
        return self.reward_fn(batch.images, prompts)

    @staticmethod
    def means(scores: Dict[str, torch.Tensor], prefix: str) -> Dict[str, float]:
        return {f"{prefix}{k}": float(v.mean()) for k, v in scores.items()}

    def maybe_log_images(self, images: torch.Tensor, step: int) -> None:
        every = self.cfg.logger.image_every
        if every and step % every == 0:
            self.logger.log_images(images, step)

    # ----------------------------------------------------------------- training
    def train(self) -> float:
        trainer = self.cfg.trainer
        self.position = "the evaluation before training"
        initial = self.evaluate()
        self.logger.log(self.eval_metrics(initial), self.start_step, echo=tqdm.write, force_console=True)
        bar = tqdm(range(self.start_step, trainer.steps), desc=self.cfg.algorithm.name, disable=not trainer.progress_bar, initial=self.start_step, total=trainer.steps)
        for step in bar:
            self.position = f"training step {step + 1}"
            metrics = self.step_fn(step)
            bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.4f}" for k in ("reward/reward", "train/loss") if k in metrics})
            done = step + 1
            if trainer.eval_every and done % trainer.eval_every == 0 and done < trainer.steps:
                metrics.update(self.eval_metrics(self.evaluate()))
            self.logger.log(metrics, done, echo=tqdm.write)
            if trainer.save_every and done % trainer.save_every == 0:
                self.save_checkpoint(done)
        self.position = "the final evaluation"
        final = self.evaluate()
        self.logger.log(self.eval_metrics(final), trainer.steps, echo=tqdm.write, force_console=True)
        self.save_checkpoint(trainer.steps)
        self.write_eval_summary(initial["reward"], final["reward"])
        before, after = float(initial["reward"].mean()), float(final["reward"].mean())
        print(f"eval reward (held-out prompts and seeds): before {before:.4f} -> after {after:.4f}")
        return after

    def write_eval_summary(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Per-image held-out rewards before and after training (same prompts and seeds)."""
        summary = {"before": before.tolist(), "after": after.tolist(), "start_step": self.start_step, "steps": self.cfg.trainer.steps}
        (self.output_dir / "eval.json").write_text(json.dumps(summary))

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, step: int) -> Path:
        state = {"optimizer": self.worker.optimizer_state_dict(), "rng": checkpoint.rng_state(), "config": OmegaConf.to_yaml(self.cfg)}
        return checkpoint.save_checkpoint(self.checkpoint_dir, step, self.worker.lora_state_dict(), self.cfg.model.lora, state)

    def load_checkpoint(self, directory: Path) -> None:
        lora, state = checkpoint.load_checkpoint(directory)
        self.worker.load_state(lora, state["optimizer"])
        checkpoint.set_rng_state(state["rng"])
        self.start_step = state["step"]

    def cleanup(self) -> None:
        """Close what `setup` opened, also after a set-up that failed half-way."""
        if self.logger is not None:
            self.logger.close()
        if self.worker is not None:
            self.worker.shutdown()


def run(cfg: DictConfig) -> float:
    """Validate (before any model loads), build, train; returns the final eval reward."""
    cfg = validate(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.train()
    except WorkerFailure as failure:
        latest = checkpoint.latest_checkpoint(trainer.checkpoint_dir)
        kept = f"the last checkpoint, {latest}, is intact (trainer.resume=auto continues)" if latest else "no checkpoint was saved yet"
        raise WorkerFailure(f"{failure}; during {trainer.position}. Training stopped: {kept}") from None
    finally:
        trainer.cleanup()
