"""The training loop (one driver process): set-up, the algorithm's steps (`omni.algorithms`),
evaluation on held-out prompts and seeds (omni/evaluation.py; watched by the reward-hacking sentinel,
`omni.sentinel`, when `sentinel.enabled`: it warns, stops, or rolls back to the newest
checkpoint saved where its rules held), logging, checkpoints and, at the end, the results
bundle in `<run dir>/results/` (`omni.results`).

Everything random is a function of (seed, step): the prompts of a step, the seeds of its
images, the SDE window and the update's shuffling. A resumed run therefore needs only the
step, the trained weights (the LoRA, or the transformer with full fine-tuning), the
optimizer state and the algorithm's own state (offline DPO's data position) to continue
exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from omni import checkpoint, results
from omni.algorithms import get_algorithm
from omni.async_rollout import AsyncRollouts
from omni.atomic import write_text
from omni.config import TrainConfig
from omni.config.errors import ConfigError, require
from omni.context import StepContext
from omni.data.prompt_sets import load_prompt_set
from omni.ema import LoraEMA
from omni.evaluation import EvalResult, Evaluator, before_after_table, load_eval_prompts
from omni.loggers import MetricsLogger
from omni.models import get_family
from omni.rewards import WeightedReward
from omni.rewards.base import RewardUnavailable
from omni.rollout.engine_client import EngineError, EngineUnreachable
from omni.run_lock import RunLock
from omni.schedules import lr_factor
from omni.sentinel import Evaluation, Finding, Sentinel, image_statistics
from omni.validation import validate
from omni.workers import WorkerFailure, build_actor_rollout

logger = logging.getLogger(__name__)

# In the run directory: the config as validated and resolved, the one the run uses.
CONFIG_FILE = "resolved_config.yaml"


# What the progress bar shows: the quantities that move during training (a loss near zero
# by construction, as GRPO's is, tells nothing), under short names, those a step reports.
PROGRESS_FIELDS = {
    "reward/reward": "reward",
    "train/kl": "kl",
    "train/clip_fraction": "clipped",
    "train/implicit_accuracy": "accuracy",
    "train/reward_margin": "margin",
    "train/grad_norm": "grad",
    "train/lr": "lr",
}


def progress_fields(metrics: Dict[str, float]) -> Dict[str, str]:
    return {short: f"{metrics[key]:.3g}" for key, short in PROGRESS_FIELDS.items() if key in metrics}


class TrainingStopped(RuntimeError):
    """The run stopped itself (non-finite gradients); the message names the last checkpoint."""


class SentinelStopped(TrainingStopped):
    """The reward-hacking sentinel stopped the run; the message names the rule, the step and the figures."""


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
        train_prompts = load_prompt_set(cfg.data.train, "data.train", cfg.data.skip_bad_rows)
        reward = WeightedReward(cfg.reward.components, cfg.reward.batch_size, cfg.reward.nonfinite)
        self.ctx = StepContext(cfg, self.family, train_prompts, load_eval_prompts(cfg), reward)
        self.evaluator = Evaluator(cfg, self.ctx)
        self.algorithm = get_algorithm(cfg.algorithm.name)(self.ctx)  # reads its data before any model loads
        self.resume_dir = self._resume_dir()  # checked before any model loads
        self.own_checkpoints = self.continued_checkpoints()  # what keep_last_checkpoints may delete
        self.continued = [results.relative_name(p, self.output_dir) for p in self.own_checkpoints]
        results.check_replaceable(self.output_dir / results.RESULTS_DIR, self.continued)  # before any model loads
        self.last_evaluation: Optional[results.EvaluationRecord] = None  # its images go in results/report.html
        self.start_step = 0
        self.bad_steps = 0  # consecutive steps whose update had a non-finite gradient
        self.ema = LoraEMA(cfg.trainer.ema_decay) if cfg.trainer.ema_decay is not None else None
        watched = cfg.sentinel.enabled
        self.sentinel = Sentinel(cfg.sentinel) if watched else None
        # the gold rewards: scored on the evaluations' images, never trained on
        self.gold = WeightedReward(cfg.sentinel.gold, cfg.reward.batch_size) if watched and cfg.sentinel.gold else None
        self.position = "set-up"  # where the loop is, for a failure's message
        self.rollouts: Optional[AsyncRollouts] = None  # trainer.rollout_mode=async
        self.resumed_rollouts: Optional[dict] = None  # a checkpoint's pending async rollouts

    @property
    def worker(self):
        return self.ctx.worker

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.output_dir / CONFIG_FILE, self.config_yaml())
        self.ctx.reward.setup()
        self.evaluator.setup()
        if self.gold is not None:
            self.gold.setup()
        keep_reference = self.algorithm.uses_reference(self.cfg)
        snapshots = self.algorithm.snapshot_adapters(self.cfg)
        if self.cfg.trainer.rollout_mode == "async":  # first: it checks the cluster for both groups
            algorithm = self.algorithm
            self.rollouts = AsyncRollouts(
                self.ctx, lambda ctx, step: algorithm.rollout(step, ctx), model_path(self.cfg.model)
            )
        self.ctx.worker = build_actor_rollout(self.cfg, model_path(self.cfg.model), keep_reference, snapshots)
        self.algorithm.setup()
        self.ctx.logger = MetricsLogger(self.cfg, self.output_dir)
        if self.resume_dir is not None:
            self.load_checkpoint(self.resume_dir)
        elif self.cfg.model.lora is not None and self.cfg.model.lora.init_from is not None:
            self.load_initial_lora(self.cfg.model.lora.init_from)
        if self.rollouts is not None:
            self.start_async_rollouts()

    def start_async_rollouts(self) -> None:
        """The rollout group gets the weights the first step starts from (and, on resume, the
        rollouts the checkpoint had sampled ahead, redone from their seeds)."""
        self.algorithm.rollouts = self.rollouts
        current = self.worker.trained_state_dict()
        if self.resumed_rollouts:
            self.rollouts.load_state_dict(self.resumed_rollouts, self.start_step, current)
        else:
            self.rollouts.publish(self.start_step, current)

    def _resume_dir(self) -> Optional[Path]:
        """The checkpoint to continue from: `trainer.resume`, or with "auto" the newest intact
        one (damaged ones are named in the log and passed over), after cleaning up what a
        killed save left behind. Refused (ConfigError, before any model loads): checkpoints of
        another configuration, checkpoints none of which can be used, and a run that would
        write over checkpoints it does not continue from."""
        resume = self.cfg.trainer.resume
        if resume == "auto":
            for done in checkpoint.clean_interrupted_writes(self.checkpoint_dir):
                logger.warning("checkpoints: %s (left by an interrupted save)", done)
            try:
                found, skipped = checkpoint.resumable_checkpoint(self.checkpoint_dir, self.cfg.model)
            except checkpoint.CheckpointMismatch as error:
                raise ConfigError(
                    f"trainer.resume=auto: {error}; nothing was written. To start afresh, {self.elsewhere()}"
                ) from None
            require(
                not skipped or found is not None,
                f"trainer.resume=auto found checkpoints in {self.checkpoint_dir} but none it can use: "
                f"{'; '.join(skipped)}. Nothing was written; to start afresh, {self.elsewhere()}",
            )
            for reason in skipped:  # only newer ones than `found`, which its later saves replace
                logger.warning("trainer.resume=auto passes over a damaged checkpoint: %s", reason)
            return found
        found = Path(resume) if resume else None
        self.check_no_overwrite(found)
        return found

    def check_no_overwrite(self, resumed: Optional[Path]) -> None:
        """The checkpoints this run would replace: those after the step it starts from."""
        start = checkpoint.step_of(resumed) if resumed is not None else 0
        later = [p.name for p in checkpoint.checkpoint_dirs(self.checkpoint_dir) if checkpoint.step_of(p) > start]
        how = f"continues from {resumed}" if resumed is not None else "starts at step 0"
        require(
            not later,
            f"{self.checkpoint_dir} holds checkpoints of an earlier run ({', '.join(reversed(later))}) that this run "
            f"would write over: it {how}. Continue that run with trainer.resume=auto, or {self.elsewhere()}",
        )

    def elsewhere(self) -> str:
        return f"give this run its own directory (hydra.run.dir=...) or move {self.checkpoint_dir} away"

    # ----------------------------------------------------------------- evaluation
    @contextlib.contextmanager
    def evaluated_weights(self):
        """The LoRA that evaluations and exports use: the EMA when `trainer.ema_decay` is set
        (swapped into the actor and the engine, then the trained LoRA is put back)."""
        if self.ema is None or self.ema.average is None:
            yield
            return
        trained = self.worker.lora_state_dict()
        self.worker.load_adapter(self.ema.weights(trained))
        try:
            yield
        finally:
            self.worker.load_adapter(trained)

    def evaluate(self) -> Dict[str, torch.Tensor]:
        """The finite held-out scores of each reward, one per image."""
        result = self.evaluate_and_watch(self.start_step, watch=False)[0]
        return {name: result.valid(name) for name in result.scores}

    def evaluate_and_watch(self, step: int, watch: bool = True) -> Tuple[EvalResult, Dict[str, float], list]:
        """The evaluation at `step` (omni/evaluation.py; its images logged at `step`), its
        metrics with what the algorithm measures on held-out data and, with the sentinel,
        the sentinel's metrics and findings on the same images."""
        with self.evaluated_weights():
            result, images, latents = self.evaluator.run(step, self.position)
        prompts, n = self.evaluator.prompts, self.cfg.eval.images_per_prompt
        self.last_evaluation = results.record_evaluation(prompts, images, result.scores["reward"], n)
        if self.ctx.logger is not None and result.images is not None:
            self.ctx.logger.log_eval_samples(result.images, result.prompts, result.scores, step)
        metrics = {**result.metrics(), **self.algorithm.evaluate()}
        if self.sentinel is None or not watch:
            return result, metrics, []
        gold = self.gold.component_scores(images, prompts) if self.gold is not None else {}
        now = Evaluation(step, result.scores["reward"], gold, image_statistics(images, latents))
        found = self.sentinel.judge(now)
        return result, {**metrics, **self.sentinel.metrics(now, found)}, found

    def respond(self, found: List[Finding], step: int) -> bool:
        """The sentinel's action on what it found at `step`'s evaluation: warn (False), stop
        (SentinelStopped), or roll back (True: the run continues from the checkpoint loaded)."""
        if not found:
            return False
        message = "; ".join(finding.message for finding in found)
        action = self.cfg.sentinel.action.value
        if action == "warn":
            logger.warning("%s (sentinel.action=warn: training goes on)", message)
            return False
        if action == "stop":
            raise SentinelStopped(f"{message} (sentinel.action=stop)")
        target = self.rollback_target(step)
        if target is None or not self.sentinel.can_roll_back():
            why = (
                f"no checkpoint was saved at an evaluation where the rules held (held at steps {self.sentinel.held})"
                if target is None
                else f"the run already made its sentinel.max_rollbacks={self.cfg.sentinel.max_rollbacks} rollbacks"
            )
            raise SentinelStopped(f"{message} (sentinel.action=rollback, but {why})")
        rollbacks, scale = self.sentinel.rollbacks + 1, self.sentinel.lr_scale * self.cfg.sentinel.lr_factor
        if self.ema is not None:  # the checkpoint's average replaces the one that went on past it
            self.ema = LoraEMA(self.cfg.trainer.ema_decay)
        self.load_checkpoint(target)
        self.sentinel.rollbacks, self.sentinel.lr_scale = rollbacks, scale
        logger.warning(
            "%s; rolled back to %s (the rules held at step %d), learning rate scaled by %g (sentinel.lr_factor=%g; "
            "rollback %d of at most %d)",
            message,
            target,
            self.start_step,
            scale,
            self.cfg.sentinel.lr_factor,
            rollbacks,
            self.cfg.sentinel.max_rollbacks,
        )
        return True

    def rollback_target(self, step: int) -> Optional[Path]:
        """The newest of this run's checkpoints saved before `step` at an evaluation where the rules held."""
        held = [
            p for p in self.own_checkpoints if p.exists() and checkpoint.step_of(p) < step
            and checkpoint.step_of(p) in self.sentinel.held
        ]  # fmt: skip
        return max(held, key=checkpoint.step_of, default=None)

    # ----------------------------------------------------------------- training
    def train(self) -> float:
        trainer, metrics_log = self.cfg.trainer, self.ctx.logger
        self.position = "the evaluation before training"
        initial, metrics, found = self.evaluate_and_watch(self.start_step)
        metrics_log.log(metrics, self.start_step, force_console=True)
        if trainer.eval_only:
            for finding in found:
                logger.warning(finding.message)
            reward = initial.mean()
            logger.info(
                "eval-only run (trainer.eval_only=true, no training): held-out reward %.4f at step %d",
                reward,
                self.start_step,
            )
            return reward
        self.respond(found, self.start_step)
        while True:  # again after each rollback of the sentinel's
            if not self.train_steps():
                continue
            self.position = "the final evaluation"
            final, metrics, found = self.evaluate_and_watch(trainer.steps)
            metrics_log.log(metrics, trainer.steps, force_console=True)
            if not self.respond(found, trainer.steps):
                break
        saved = self.save_checkpoint(trainer.steps)
        self.write_results(saved, metrics, self.write_eval_summary(initial, final))
        before, after = initial.mean(), final.mean()
        logger.info("eval reward (held-out prompts and seeds): before %.4f -> after %.4f", before, after)
        logger.info("held-out evaluation before -> after training:\n%s", before_after_table(initial, final))
        return after

    def train_steps(self) -> bool:
        """The steps from `start_step` up to `trainer.steps`, with their evaluations and
        checkpoints; False when the sentinel rolled back (`start_step` is then the checkpoint's)."""
        trainer, metrics_log = self.cfg.trainer, self.ctx.logger
        bar = tqdm(
            range(self.start_step, trainer.steps),
            desc=self.cfg.algorithm.name,
            disable=not trainer.progress_bar,
            initial=self.start_step,
            total=trainer.steps,
        )
        scale = self.sentinel.lr_scale if self.sentinel is not None else 1.0  # lowered by each rollback
        with logging_redirect_tqdm():  # log lines above the bar, not through it
            for step in bar:
                self.position = f"training step {step + 1}"
                metrics = self.run_step(step, scale)
                self.count_bad_step(metrics, step + 1)
                bar.set_postfix(progress_fields(metrics), refresh=False)
                done, found = step + 1, []
                every = self.cfg.eval.every
                if every and done % every == 0 and done < trainer.steps:
                    _, evaluation, found = self.evaluate_and_watch(done)
                    metrics.update(evaluation)
                metrics_log.log(metrics, done)
                if self.respond(found, done):
                    bar.close()
                    return False
                if trainer.save_every and done % trainer.save_every == 0 and done < trainer.steps:
                    self.save_checkpoint(done)
        return True

    def run_step(self, step: int, lr_scale: float = 1.0) -> Dict[str, float]:
        """One training step at its learning rate; then the new weights go to the rollouts
        sampled ahead (async) and into the EMA."""
        trainer = self.cfg.trainer
        factor = lr_factor(step, trainer.steps, trainer.lr_schedule.value, trainer.warmup_steps)
        lr = self.worker.set_lr(trainer.lr * lr_scale * factor)
        metrics = {**self.algorithm.step(step), "train/lr": lr}
        if self.rollouts is None and self.ema is None:
            return metrics
        trained = self.worker.trained_state_dict()  # collected once (an EMA is of a LoRA only)
        if self.rollouts is not None:  # the weights the rollouts submitted from now on use
            self.rollouts.publish(step + 1, trained)
        if self.ema is not None:
            self.ema.update(trained)
        return metrics

    def count_bad_step(self, metrics: Dict[str, float], step: int) -> None:
        """A step whose optimizer steps were skipped for a non-finite gradient (the weights
        kept their values); `trainer.max_bad_steps` of them in a row stop the run."""
        bad = metrics.get("train/skipped_nonfinite", 0.0) > 0 or not math.isfinite(metrics.get("train/grad_norm", 0.0))
        self.bad_steps = self.bad_steps + 1 if bad else 0
        if bad:
            logger.warning("step %d: non-finite gradient; its optimizer steps were skipped", step)
        if self.bad_steps >= self.cfg.trainer.max_bad_steps:
            raise TrainingStopped(
                f"{self.bad_steps} steps in a row (up to step {step}) had a non-finite loss or gradient "
                f"(trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}); the weights were not changed by them"
            )

    def write_eval_summary(self, initial: EvalResult, final: EvalResult) -> dict:
        """Per-image held-out rewards before and after training (same prompts and seeds): the
        training reward's finite values, and under `scores` every score image by image (None
        where not finite), so a paired test can use any of them (scene_geneval/accuracy)."""
        as_list = lambda values: [v if math.isfinite(v) else None for v in values.tolist()]  # noqa: E731
        summary = {
            "before": initial.valid().tolist(),
            "after": final.valid().tolist(),
            "scores": {
                name: {"before": as_list(initial.scores[name]), "after": as_list(final.scores[name])}
                for name in initial.scores
            },
            "start_step": self.start_step,
            "steps": self.cfg.trainer.steps,
        }
        (self.output_dir / "eval.json").write_text(json.dumps(summary))
        return summary

    def write_results(self, saved: Optional[Path], metrics: Dict[str, float], summary: Optional[dict]) -> Path:
        """`results/` (omni/results.py) for the checkpoint `saved` (None: the base model) and
        evaluation `metrics`."""
        record = self.last_evaluation
        return results.write_results(
            self.output_dir / results.RESULTS_DIR,
            config=self.config_yaml(),
            metrics=metrics,
            per_category=results.per_category(record.tags, record.scores),
            history=self.ctx.logger.history,
            images=record.images,
            checkpoint_files=[p for p in saved.rglob("*") if p.is_file()] if saved is not None else [],
            prompt_files=results.data_files(self.cfg),
            overrides=results.hydra_overrides(),
            made_by=results.relative_name(saved, self.output_dir) if saved is not None else "the base model",
            replaces=self.continued,
            before_after=summary,
            start_step=self.start_step,
        )

    # ----------------------------------------------------------------- checkpoints
    def config_yaml(self) -> str:
        """The resolved, validated config the run uses (not Hydra's `.hydra/config.yaml`, which
        is the composed one, before validation filled in the model's values)."""
        return OmegaConf.to_yaml(OmegaConf.structured(self.cfg))

    def save_checkpoint(self, step: int) -> Path:
        """The trained weights: the LoRA, or the whole transformer with full fine-tuning. The
        exported LoRA is the EMA when there is one; the trained LoRA, which training
        continues from, then goes into the trainer state."""
        state = {
            "optimizer": self.worker.optimizer_state_dict(),
            "rng": checkpoint.rng_state(),
            "config": self.config_yaml(),
            "algorithm": self.algorithm.state_dict(),
        }
        if self.sentinel is not None:
            state["sentinel"] = self.sentinel.state_dict()
        if self.rollouts is not None:
            state["async_rollouts"] = self.rollouts.state_dict()
        weights = self.worker.trained_state_dict()
        if self.ema is not None:
            state["trained_lora"], weights = weights, self.ema.weights(weights)
        lora = self.cfg.model.lora
        config = None if lora is not None else self.family.transformer_config(model_path(self.cfg.model))
        saved = checkpoint.save_checkpoint(self.checkpoint_dir, step, weights, lora, state, self.family, config)
        self.own_checkpoints.append(saved)
        keep = self.cfg.trainer.keep_last_checkpoints
        if keep is not None:
            for old in checkpoint.prune_checkpoints(self.own_checkpoints, keep):
                logger.info("deleted %s (trainer.keep_last_checkpoints=%d)", old, keep)
            self.own_checkpoints = [p for p in self.own_checkpoints if p.exists()]
        return saved

    def load_checkpoint(self, directory: Path) -> None:
        exported, state = checkpoint.load_checkpoint(directory, self.family)
        weights = state.get("trained_lora", exported)
        if self.ema is not None and "trained_lora" in state:
            self.ema.update(exported)  # the saved average starts this run's
        self.worker.load_state(weights, state["optimizer"])
        checkpoint.set_rng_state(state["rng"])
        self.start_step = state["step"]
        self.algorithm.load_state_dict(state.get("algorithm", {}), self.start_step)
        if self.sentinel is not None:
            self.sentinel.load_state_dict(state.get("sentinel", {}))
        self.resumed_rollouts = state.get("async_rollouts")

    def load_initial_lora(self, path: str) -> None:
        """`model.lora.init_from`: the LoRA training starts from (checked at validation)."""
        file = checkpoint.lora_file(Path(path))
        try:
            self.worker.load_adapter(checkpoint.load_lora_file(file))
        except (KeyError, ValueError) as error:
            raise ConfigError(f"model.lora.init_from={path}: {file} does not fit this model's LoRA: {error}") from None
        logger.info("LoRA initialised from %s", file)

    def continued_checkpoints(self) -> list:
        """The checkpoints of the run this one continues, in its own directory: the resumed
        one and those before it. A checkpoint resumed from another directory is not ours."""
        if self.resume_dir is None or self.resume_dir.resolve().parent != self.checkpoint_dir.resolve():
            return []
        start = checkpoint.step_of(self.resume_dir)
        return [p for p in checkpoint.checkpoint_dirs(self.checkpoint_dir) if checkpoint.step_of(p) <= start]

    def cleanup(self) -> None:
        """Close what `setup` opened, also after a set-up that failed half-way."""
        self.algorithm.close()
        if self.ctx.logger is not None:
            self.ctx.logger.close()
        if self.worker is not None:
            self.worker.shutdown()
        if self.rollouts is not None:  # after the training group: it may own the Ray connection
            self.rollouts.close()
        self.ctx.reward.teardown()
        self.evaluator.close()
        if self.gold is not None:
            self.gold.teardown()


def run(cfg: DictConfig | TrainConfig) -> float:
    """Validate (before any model loads), build, train; returns the final eval reward."""
    cfg = validate(cfg)
    with RunLock(Path(cfg.output_dir)):
        trainer = Trainer(cfg)
        try:
            trainer.setup()
            return trainer.train()
        except (
            WorkerFailure,
            TrainingStopped,
            RewardUnavailable,
            EngineUnreachable,
            EngineError,
            checkpoint.CheckpointSaveFailed,
        ) as failure:
            raise type(failure)(f"{failure}; during {trainer.position}. Training stopped: {kept(trainer)}") from None
        except KeyboardInterrupt:
            logger.error("interrupted during %s. %s", trainer.position, kept(trainer))
            raise SystemExit(130) from None
        finally:
            trainer.cleanup()


def kept(trainer: Trainer) -> str:
    """What is on disk to continue from, and how."""
    latest = checkpoint.latest_checkpoint(trainer.checkpoint_dir)
    if latest is None:
        return "no checkpoint was saved yet"
    return (
        f"the last checkpoint, {latest}, is intact; continue with trainer.resume=auto "
        f"hydra.run.dir={trainer.output_dir}"
    )
