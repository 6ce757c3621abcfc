"""Rollout engines behind one interface (`omni.rollout.base.RolloutEngine`)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

ENGINES = ("diffusers", "vllm")


def build_engine(cfg: DictConfig, model_path: str, device: torch.device, dtype: torch.dtype):
    """The engine named by `rollout.engine`, holding its own copy of the model."""
    if cfg.rollout.engine == "diffusers":
        return _diffusers_engine(cfg, model_path, device, dtype)
    if cfg.rollout.engine == "vllm":
        return _vllm_engine(cfg, model_path, device, dtype)
    raise ValueError(f"rollout.engine={cfg.rollout.engine}: expected one of {ENGINES}")


def _diffusers_engine(cfg, model_path, device, dtype):
    from omni.rollout.diffusers_engine import load_diffusers_engine

    return load_diffusers_engine(model_path, device, dtype, cfg.rollout.micro_batch_size, cfg.rollout.load_base)


def _vllm_engine(cfg, model_path, device, dtype):
    from omni.rollout.vllm_engine import VllmEngine, vllm_options

    rollout = cfg.rollout
    options = vllm_options(rollout.options)
    return VllmEngine.start(options, model_path, device, dtype, rollout.micro_batch_size, rollout.load_base, cfg.output_dir)
