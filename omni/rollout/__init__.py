"""Rollout engines behind one interface (`omni.rollout.base.RolloutEngine`), one module
each: `omni/rollout/<engine>_engine.py` defines `build(cfg, family, model_path, device,
dtype)`, chosen by `rollout.engine`."""

from __future__ import annotations

import torch

from omni.models.base import ModelFamily
from omni.registry import Registry

ENGINES = Registry(__name__, "build", "rollout engine", "rollout.engine", suffix="_engine")


def build_engine(cfg, family: ModelFamily, model_path: str, device: torch.device, dtype: torch.dtype):
    """The engine named by `rollout.engine`, holding its own copy of the model."""
    return ENGINES.get(cfg.rollout.engine.value)(cfg, family, model_path, device, dtype)
