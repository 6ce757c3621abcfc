"""Rollout engines behind one interface (`omni.rollout.base.RolloutEngine`), one module
each: `omni/rollout/<engine>_engine.py` defines `build(cfg, family, model_path, device,
dtype)`, chosen by `rollout.engine`."""

from __future__ import annotations

import torch

from omni.models.base import ModelFamily
from omni.registry import Registry

ENGINES = Registry(__name__, "build", "rollout engine", "rollout.engine", suffix="_engine")


def build_engine(cfg, family: ModelFamily, model_path: str, device: torch.device, dtype: torch.dtype, actor=None):
    """The engine named by `rollout.engine`: sampling with `actor`, the trained transformer,
    when given (an in-process engine only), else holding its own copy of the model."""
    build = ENGINES.get(cfg.rollout.engine.value)
    return build(cfg, family, model_path, device, dtype) if actor is None else build(cfg, family, model_path, device, dtype, actor=actor)
