"""The `omni-train` command (installed with the package) and `python recipes/train.py`: the same
Hydra application, whose config groups ship in the package (`pkg://omni.conf`); and likewise
`omni-evaluate` and `python recipes/evaluate.py` (omni/eval_run.py).

    omni-train                                   # tiny offline SD3 on the CPU
    omni-train model=sd3 model.path=/ckpt/sd3.5-medium rollout=vllm trainer=gpu
    omni-train -m seed=1,2 algorithm.clip_range=1e-4,2e-4
    omni-train --cfg job                         # print the composed config

Compose -> validate (before any model loads) -> build -> train. Returns the final evaluation
reward, so Hydra sweepers can optimise it.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from omni.config import CONFIG_PATH, EvaluateConfig
from omni.config.eval import moved_overrides
from omni.config.presets import describe_model_algorithm_preset
from omni.registration import register_configs

register_configs()
log = logging.getLogger("omni.recipes.train")


def refuse_moved_keys(argv=None) -> None:
    """A key of the command line that moved to another group stops the command, naming the
    new key (Hydra's own error would only say the old one does not exist)."""
    moved = moved_overrides(sys.argv[1:] if argv is None else argv)
    if moved:
        sys.exit(f"Error: {'; '.join(moved)}")


@hydra.main(config_path=CONFIG_PATH, config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> float:
    from omni.trainer import run

    log.info(describe_model_algorithm_preset(cfg))
    return run(cfg)


def train():
    refuse_moved_keys()
    return _train()


@hydra.main(config_path=CONFIG_PATH, config_name="evaluate", version_base="1.3")
def _evaluate(cfg: DictConfig) -> float:
    from omni.eval_run import evaluate as run_evaluation

    return run_evaluation(cfg)


def evaluate():
    """`omni-evaluate`: a checkpoint (checkpoint=...) or the base model on held-out prompts."""
    refuse_moved_keys()
    register_configs(EvaluateConfig)
    return _evaluate()
