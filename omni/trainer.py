"""The training loop (one driver process): set-up, the algorithm's steps (`omni.algorithms`),
evaluation on held-out prompts and seeds, logging and checkpoints.

Everything random is a function of (seed, step): the prompts of a step, the seeds of its
images, the SDE window and the update's shuffling. A resumed run therefore needs only the
step, the LoRA and the optimizer state to continue exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from omni import checkpoint
from omni.algorithms import get_algorithm
from omni.config import TrainConfig
from omni.config.validate import validate
from omni.context import StepContext, means, step_seeds
from omni.data.prompts import load_prompts
from omni.loggers import MetricsLogger
from omni.models import get_family
from omni.rewards import WeightedReward
from omni.workers import WorkerFailure, build_actor_rollout


def model_path(model) -> str:
    """The checkpoint directory to load: the cached tiny model, built on first use, or model.path."""
    if model.tiny_seed is not None:
        return str(get_family(model.family).tiny_path(model.cache_dir, model.tiny_seed))
    return str(Path(model.path).expanduser())


class Trainer:
    """Set-up, the step loop, evaluation and checkpoints; the algorithm's step is `algorithm`."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.family = get_family(cfg.model.family)
        train_prompts = load_prompts(cfg.data.train, "data.train")
        eval_prompts = load_prompts(cfg.data.eval, "data.eval") if cfg.data.eval else train_prompts
        reward = WeightedReward(cfg.reward.components, cfg.reward.batch_size)
        self.ctx = StepContext(cfg, self.family, train_prompts, eval_prompts, reward)
        self.algorithm = get_algorithm(cfg.algorithm.name)(self.ctx)  # reads its data before any model loads
        self.start_step = 0
        self.position = "set-up"  # where the loop is, for a worker failure's message

    @property
    def worker(self):
        return self.ctx.worker

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.ctx.reward.setup()
        self.ctx.worker = build_actor_rollout(self.cfg, model_path(self.cfg.model))
        self.algorithm.setup()
        self.ctx.logger = MetricsLogger(self.cfg, self.output_dir)
        resume = self._resume_dir()
        if resume is not None:
            self.load_checkpoint(resume)

    def _resume_dir(self) -> Optional[Path]:
        resume = self.cfg.trainer.resume
        if resume == "auto":
            return checkpoint.latest_checkpoint(self.checkpoint_dir)
        return Path(resume) if resume else None

    # ----------------------------------------------------------------- evaluation
    def eval_metrics(self, scores: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Mean held-out rewards, plus what the algorithm measures on held-out data."""
        return {**means(scores, "eval/"), **self.algorithm.evaluate()}

    def evaluate(self) -> Dict[str, torch.Tensor]:
        """Rewards of ODE samples on the held-out prompts and seeds, one per image."""
        n = self.cfg.trainer.eval_images_per_prompt
        prompts = [p for p in self.ctx.eval_prompts for _ in range(n)]
        seeds = step_seeds(self.cfg.trainer.eval_seed, 0, len(prompts))
        batch = self.worker.generate(prompts, seeds, self.ctx.sampling_options())
        return self.ctx.reward(batch.images, prompts)

    # ----------------------------------------------------------------- training
    def train(self) -> float:
        trainer, logger = self.cfg.trainer, self.ctx.logger
        self.position = "the evaluation before training"
        initial = self.evaluate()
        logger.log(self.eval_metrics(initial), self.start_step, echo=tqdm.write, force_console=True)
        bar = tqdm(range(self.start_step, trainer.steps), desc=self.cfg.algorithm.name, disable=not trainer.progress_bar, initial=self.start_step, total=trainer.steps)
        for step in bar:
            self.position = f"training step {step + 1}"
            metrics = self.algorithm.step(step)
            bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.4f}" for k in ("reward/reward", "train/loss") if k in metrics})
            done = step + 1
            if trainer.eval_every and done % trainer.eval_every == 0 and done < trainer.steps:
                metrics.update(self.eval_metrics(self.evaluate()))
            logger.log(metrics, done, echo=tqdm.write)
            if trainer.save_every and done % trainer.save_every == 0 and done < trainer.steps:
                self.save_checkpoint(done)
        self.position = "the final evaluation"
        final = self.evaluate()
        logger.log(self.eval_metrics(final), trainer.steps, echo=tqdm.write, force_console=True)
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
        config_yaml = OmegaConf.to_yaml(OmegaConf.structured(self.cfg))
        state = {"optimizer": self.worker.optimizer_state_dict(), "rng": checkpoint.rng_state(), "config": config_yaml}
        return checkpoint.save_checkpoint(self.checkpoint_dir, step, self.worker.lora_state_dict(), self.cfg.model.lora, state, self.family)

    def load_checkpoint(self, directory: Path) -> None:
        lora, state = checkpoint.load_checkpoint(directory, self.family)
        self.worker.load_state(lora, state["optimizer"])
        checkpoint.set_rng_state(state["rng"])
        self.start_step = state["step"]

    def cleanup(self) -> None:
        """Close what `setup` opened, also after a set-up that failed half-way."""
        if self.ctx.logger is not None:
            self.ctx.logger.close()
        if self.worker is not None:
            self.worker.shutdown()
        self.ctx.reward.teardown()


def run(cfg: DictConfig | TrainConfig) -> float:
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
