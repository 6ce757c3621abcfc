"""Typed configuration: the schemas of every config group and their registration with Hydra.

The config groups ship in the package, in omni/conf/ (`CONF_DIR`; Hydra's `CONFIG_PATH`).
`omni/conf/train.yaml` starts from the `train_schema` node (registered by `omni.registration`), so each group's YAML
merges into a typed dataclass: an unknown key or a wrong type fails at composition, naming
the key (a key appended with `+key=value` gets past Hydra's check; validation's first step,
`omni.validation.to_schema`, refuses it). Defaults live in the dataclasses; the YAML
files state only what differs, and a mandatory field (`???`) may carry a `hint` in its
metadata: what the error of a missing value tells the user to pass.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from omni.config.algorithm import AlgorithmConfig
from omni.config.data import DataConfig
from omni.config.eval import EvalConfig
from omni.config.logger import LoggerConfig
from omni.config.model import FSDPConfig, LoraConfig, ModelConfig
from omni.config.reward import RewardConfig
from omni.config.rollout import RolloutConfig
from omni.config.sentinel import SentinelConfig
from omni.config.trainer import TrainerConfig

# The config groups: a folder of the package, so an installed (non-editable) omni-recipes has them.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
CONFIG_PATH = "pkg://omni.conf"


@dataclass
class TrainConfig:
    seed: int = 0
    output_dir: str = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)


@dataclass
class EvaluateConfig(TrainConfig):
    """`omni-evaluate`'s config (omni/conf/evaluate.yaml): a training config, and the checkpoint
    to evaluate."""

    # A run's saved checkpoint directory (<run dir>/checkpoints/step_NNNNNN); null: the base model.
    checkpoint: Optional[str] = None


__all__ = [
    "CONFIG_PATH",
    "CONF_DIR",
    "AlgorithmConfig",
    "DataConfig",
    "EvalConfig",
    "EvaluateConfig",
    "FSDPConfig",
    "LoggerConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "SentinelConfig",
    "TrainConfig",
    "TrainerConfig",
]
