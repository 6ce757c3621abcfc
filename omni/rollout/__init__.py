"""Rollout engines behind one interface (`omni.rollout.base.RolloutEngine`)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

ENGINES = ("diffusers",)


def build_engine(cfg: DictConfig, model_path: str, device: torch.device, dtype: torch.dtype):
    """The engine named by `rollout.engine`, holding its own copy of the model."""
    if cfg.rollout.engine == "diffusers":
        return _diffusers_engine(cfg, model_path, device, dtype)
    raise ValueError(f"rollout.engine={cfg.rollout.engine}: expected one of {ENGINES}")


def _diffusers_engine(cfg, model_path, device, dtype):
    from diffusers import SD3Transformer2DModel

    from omni.models.sd3 import load_sd3_pipeline
    from omni.rollout.diffusers_engine import DiffusersEngine

    components = {}
    if not cfg.rollout.load_base:
        # A dummy transformer of the right shape; the first weight sync fills it.
        config = SD3Transformer2DModel.load_config(model_path, subfolder="transformer")
        components["transformer"] = SD3Transformer2DModel.from_config(config).to(dtype)
    pipe = load_sd3_pipeline(model_path, dtype, **components)
    return DiffusersEngine(pipe, device, cfg.rollout.micro_batch_size, has_base=cfg.rollout.load_base)
