"""The `omni-evaluate` run (recipes/evaluate.py): a checkpoint, or the base model, evaluated
on held-out prompts as the `eval` group says (omni/evaluation.py), with no training.

The checkpoint (`checkpoint=<run dir>/checkpoints/step_NNNNNN`) is loaded as a resumed run
loads it (its EMA when it has one), so the model's settings must match the training run's
(a mismatch is named before any model loads). The per-category table and the overall
figures are printed and written, with every image's prompt, seed and scores, to eval.json
in the run directory, beside a results/ bundle (omni/results.py) whose metrics.json repeats,
for the same checkpoint and eval preset, the training run's own bundle.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from omni.atomic import write_text
from omni.config.errors import ConfigError, require
from omni.evaluation import EvalResult
from omni.run_lock import RunLock
from omni.trainer import Trainer
from omni.validation import validate

logger = logging.getLogger(__name__)

RESULT_FILE = "eval.json"


def checked(cfg: DictConfig):
    """The validated config of an evaluation-only run that resumes from `checkpoint`; a missing
    or mismatched checkpoint is refused (ConfigError naming `checkpoint`) before any model loads."""
    checkpoint = cfg.checkpoint
    if checkpoint is not None:
        require(
            Path(checkpoint).is_dir(),
            f"checkpoint={checkpoint}: no such checkpoint directory (a training run saves them under "
            "<run dir>/checkpoints/step_NNNNNN); checkpoint=null evaluates the base model",
        )
    cfg = cfg.copy()
    OmegaConf.update(cfg, "trainer.eval_only", True)
    OmegaConf.update(cfg, "trainer.resume", checkpoint)
    try:
        return validate(cfg)
    except ConfigError as error:
        if checkpoint is None:
            raise
        raise ConfigError(str(error).replace(f"trainer.resume={checkpoint}", f"checkpoint={checkpoint}")) from None


def evaluate(cfg: DictConfig) -> float:
    """Validate, load, evaluate; prints the table, writes eval.json, returns the mean reward."""
    cfg = checked(cfg)
    with RunLock(Path(cfg.output_dir)):
        trainer = Trainer(cfg)
        try:
            trainer.setup()
            trainer.position = "the evaluation"
            result, metrics, _ = trainer.evaluate_and_watch(trainer.start_step, watch=False)
            trainer.ctx.logger.log(metrics, trainer.start_step, force_console=True)
            checkpoint = Path(cfg.checkpoint) if cfg.checkpoint is not None else None
            trainer.write_results(checkpoint, metrics, None)
        finally:
            trainer.cleanup()
    report(result, cfg.checkpoint, Path(cfg.output_dir))
    return result.mean()


def report(result: EvalResult, checkpoint, output_dir: Path) -> None:
    what = checkpoint if checkpoint is not None else "the base model"
    print(f"held-out evaluation of {what} ({len(result.prompts)} images):\n{result.table()}", flush=True)
    summary = {"checkpoint": checkpoint, **result.summary()}
    write_text(output_dir / RESULT_FILE, json.dumps(summary, indent=1))
    logger.info("evaluation of %s: reward %.4f; written to %s", what, result.mean(), output_dir / RESULT_FILE)
