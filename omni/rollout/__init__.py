"""Rollout engines behind one interface (`omni.rollout.base.RolloutEngine`), one module
each: `omni/rollout/<engine>_engine.py` defines `build(cfg, family, model_path, device,
dtype)`, chosen by `rollout.engine`, and may declare `Options` (its schema, a `RolloutConfig`
subclass), `can_share_actor(cfg)` (whether it can sample with the actor's transformer; absent:
never) and `check_config(cfg, family)` (its cross-group rules, run at validation)."""

from __future__ import annotations

import torch

from omni.models.base import ModelFamily
from omni.registry import Registry

ENGINES = Registry(__name__, "build", "rollout engine", "rollout.engine", suffix="_engine")


def build_engine(cfg, family: ModelFamily, model_path: str, device: torch.device, dtype: torch.dtype, actor=None):
    """The engine named by `rollout.engine`: sampling with `actor`, the trained transformer,
    when given (an in-process engine only), else holding its own copy of the model."""
    build = ENGINES.get(engine_name(cfg))
    return (
        build(cfg, family, model_path, device, dtype)
        if actor is None
        else build(cfg, family, model_path, device, dtype, actor=actor)
    )


def engine_name(cfg) -> str:
    return getattr(cfg.rollout.engine, "value", cfg.rollout.engine)


def can_share_actor(cfg) -> bool:
    """Whether `rollout.engine` can sample with the actor's transformer in this configuration."""
    rule = getattr(ENGINES.module(engine_name(cfg)), "can_share_actor", None)
    return rule is not None and rule(cfg)


def shares_actor(cfg) -> bool:
    """Whether the engine samples with the actor's transformer (`rollout.share_actor`)."""
    return can_share_actor(cfg) if cfg.rollout.share_actor is None else cfg.rollout.share_actor
