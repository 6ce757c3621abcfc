"""Rules across config groups, checked after composition and before any model loads.

Each error names the keys involved. `validate` also resolves the values other groups leave
to the model (resolution, guidance, text length) and returns the config the run uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from omni.data.prompts import load_prompts
from omni.models import sd3
from omni.rewards import check_reward_names
from omni.rollout import ENGINES

LOGGER_BACKENDS = ("console", "wandb", "tensorboard")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Block containers of each model family: what `model.fsdp.layer_prefixes` may name.
BLOCK_CONTAINERS = {"sd3": tuple(prefix.rstrip(".") for prefix in sd3.LAYER_PREFIXES)}


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending keys."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_model(model: DictConfig) -> None:
    _require(model.family in BLOCK_CONTAINERS, f"model.family={model.family}: supported {sorted(BLOCK_CONTAINERS)}")
    _require(model.dtype in DTYPES, f"model.dtype={model.dtype}: expected one of {DTYPES}")
    if model.tiny_seed is None:
        try:
            sd3.check_pretrained_dir(model.path, "model.path")
        except (OSError, ValueError) as error:
            raise ConfigError(str(error)) from None
    prefixes = list(model.fsdp.layer_prefixes)
    containers = BLOCK_CONTAINERS[model.family]
    _require(len(prefixes) > 0, f"model.fsdp.layer_prefixes is empty; {model.family} blocks are under {containers}")
    for prefix in prefixes:
        _require(
            prefix.endswith(".") and prefix.rstrip(".") in containers,
            f"model.fsdp.layer_prefixes: '{prefix}' names no block container of {model.family}; "
            f"its blocks are under {[c + '.' for c in containers]}",
        )
    _require(model.lora.rank > 0, f"model.lora.rank={model.lora.rank} must be positive")
    _require(bool(model.lora.adapter_name), "model.lora.adapter_name must not be empty")
    _require(len(model.lora.target_modules) > 0, "model.lora.target_modules is empty")
    _require(model.fsdp.version in (0, 1, 2), f"model.fsdp.version={model.fsdp.version}: expected 0, 1 or 2")


def resolution_multiple(model: DictConfig) -> int:
    """Image sizes must be multiples of the VAE's downsampling times the patch size."""
    if model.tiny_seed is not None:
        vae_factor, patch = 8, sd3.TINY_TRANSFORMER["patch_size"]
    else:
        root = Path(model.path).expanduser()
        vae = json.loads((root / "vae" / "config.json").read_text())
        patch = json.loads((root / "transformer" / "config.json").read_text())["patch_size"]
        vae_factor = 2 ** (len(vae["block_out_channels"]) - 1)
    return vae_factor * patch


def check_rollout(cfg: DictConfig) -> None:
    rollout, algo = cfg.rollout, cfg.algorithm
    _require(rollout.engine in ENGINES, f"rollout.engine={rollout.engine}: expected one of {ENGINES}")
    if rollout.engine == "vllm":
        check_vllm_rollout(rollout)
    multiple = resolution_multiple(cfg.model)
    _require(
        rollout.resolution > 0 and rollout.resolution % multiple == 0,
        f"rollout.resolution={rollout.resolution}: this model takes multiples of {multiple} "
        f"(VAE factor x patch size)",
    )
    _require(rollout.num_steps >= 2, f"rollout.num_steps={rollout.num_steps}: need at least 2")
    _require(rollout.noise_level > 0, f"rollout.noise_level={rollout.noise_level} must be positive")
    _require(rollout.micro_batch_size > 0, "rollout.micro_batch_size must be positive")
    _require(
        not (rollout.layered_summon and not rollout.load_base),
        "rollout.layered_summon=true needs the base weights already in the engine, but "
        "rollout.load_base=false starts it without them; set rollout.load_base=true or layered_summon=false",
    )
    if "sde_window_size" in algo and algo.sde_window_size > 0:
        _require(
            algo.sde_window_size <= rollout.num_steps,
            f"algorithm.sde_window_size={algo.sde_window_size} exceeds rollout.num_steps={rollout.num_steps}",
        )
        if algo.sde_window_range is not None:
            lo, hi = algo.sde_window_range
            _require(
                0 <= lo <= hi and hi + algo.sde_window_size <= rollout.num_steps,
                f"algorithm.sde_window_range={list(algo.sde_window_range)} does not fit a window of "
                f"{algo.sde_window_size} in rollout.num_steps={rollout.num_steps}",
            )


def check_vllm_rollout(rollout: DictConfig) -> None:
    """rollout=vllm: known `rollout.options`, and an engine to start or attach to."""
    from omni.rollout.vllm_engine import engine_unavailable, vllm_options

    try:
        options = vllm_options(rollout.options)
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None
    problem = engine_unavailable(options)
    _require(problem is None, f"rollout=vllm: {problem}")


def check_trainer(cfg: DictConfig) -> None:
    trainer, algo = cfg.trainer, cfg.algorithm
    _require(trainer.steps >= 0, f"trainer.steps={trainer.steps} must be >= 0")
    _require(trainer.micro_batch_size > 0, "trainer.micro_batch_size must be positive")
    _require(trainer.n_workers >= 1, f"trainer.n_workers={trainer.n_workers} must be >= 1")
    if "group_size" in algo:
        _require(algo.group_size >= 2, f"algorithm.group_size={algo.group_size}: GRPO needs at least 2 per prompt")
        _require(
            trainer.batch_size % algo.group_size == 0,
            f"algorithm.group_size={algo.group_size} does not divide trainer.batch_size={trainer.batch_size}",
        )
    _require(
        trainer.batch_size % trainer.n_workers == 0,
        f"trainer.batch_size={trainer.batch_size} does not split evenly over trainer.n_workers={trainer.n_workers}",
    )
    if trainer.resume not in (None, "auto"):
        _require(Path(trainer.resume).is_dir(), f"trainer.resume={trainer.resume}: no such checkpoint directory")
    check_workers(cfg)


def check_workers(cfg: DictConfig) -> None:
    """Workers, nodes and GPUs that describe one layout (see omni.workers.ray_cluster), and
    a sharded actor whenever there is more than one worker."""
    trainer = cfg.trainer
    workers, nodes, gpus = trainer.n_workers, trainer.nnodes, trainer.n_gpus_per_node
    _require(nodes >= 1 and gpus >= 0, f"trainer.nnodes={nodes} must be >= 1 and trainer.n_gpus_per_node={gpus} >= 0")
    if gpus > 0:
        _require(
            workers == nodes * gpus,
            f"trainer.n_workers={workers}: one worker per GPU, so trainer.nnodes={nodes} x "
            f"trainer.n_gpus_per_node={gpus} = {nodes * gpus}; set trainer.n_workers={nodes * gpus}",
        )
        _require(trainer.device != "cpu", f"trainer.device=cpu but trainer.n_gpus_per_node={gpus}; set one of them")
    else:
        _require(workers % nodes == 0, f"trainer.n_workers={workers} does not split evenly over trainer.nnodes={nodes}")
        _require(
            workers == 1 or trainer.device != "cuda",
            f"trainer.device=cuda with trainer.n_gpus_per_node=0: Ray gives the {workers} workers no GPU; "
            f"set trainer.n_gpus_per_node",
        )
    _require(
        trainer.ray_address is None or workers > 1,
        f"trainer.ray_address={trainer.ray_address} with trainer.n_workers=1: one worker runs in this process "
        f"without Ray; set trainer.n_workers > 1 to use the cluster",
    )
    _require(trainer.placement_timeout_s > 0, f"trainer.placement_timeout_s={trainer.placement_timeout_s} must be positive")
    _require(
        workers == 1 or cfg.model.fsdp.version in (1, 2),
        f"model.fsdp.version=0 with trainer.n_workers={workers}: unsharded workers would not average their "
        f"gradients and would drift apart; use model.fsdp.version=1 or 2",
    )


def check_algorithm(cfg: DictConfig) -> None:
    algo = cfg.algorithm
    if "sigma_sampling" in algo:
        from omni.algorithms.dpo import SIGMA_MODES

        _require(algo.sigma_sampling in SIGMA_MODES, f"algorithm.sigma_sampling={algo.sigma_sampling}: expected one of {SIGMA_MODES}")
        _require(algo.beta > 0, f"algorithm.beta={algo.beta} must be positive")
    if algo.name == "dpo":
        pairs = None if OmegaConf.is_missing(cfg.data, "pairs") else cfg.data.pairs
        _require(
            pairs is not None,
            "algorithm=dpo learns from preference pairs: choose data=pairs and set data.pairs=/path/to/pairs.jsonl "
            "(python scripts/make_preference_pairs.py DIR writes a small synthetic set)",
        )
        _require(Path(pairs).expanduser().exists(), f"data.pairs={pairs}: no such file or directory")
        fraction = cfg.data.pairs_eval_fraction
        _require(0 <= fraction < 1, f"data.pairs_eval_fraction={fraction}: expected a share in [0, 1)")


def check_logger(logger: DictConfig) -> None:
    unknown = sorted(set(logger.backends) - set(LOGGER_BACKENDS))
    _require(not unknown, f"logger.backends: unknown {unknown}; available {list(LOGGER_BACKENDS)}")
    _require(logger.wandb_mode in ("offline", "online", "disabled"), f"logger.wandb_mode={logger.wandb_mode}")
    _require(logger.console_every >= 1, f"logger.console_every={logger.console_every} must be >= 1")


def resolve(cfg: DictConfig) -> DictConfig:
    """A copy with the model's native sampling values filled in where the rollout left None."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if cfg.rollout.resolution is None:
        cfg.rollout.resolution = cfg.model.resolution
    if cfg.rollout.guidance_scale is None:
        cfg.rollout.guidance_scale = cfg.model.guidance_scale
    return cfg


def validate(cfg: DictConfig) -> DictConfig:
    """Check every cross-group rule; returns the resolved config. Loads no model."""
    cfg = resolve(cfg)
    check_model(cfg.model)
    check_rollout(cfg)
    check_trainer(cfg)
    check_algorithm(cfg)
    check_logger(cfg.logger)
    try:
        check_reward_names(cfg.reward.weights)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for key in ("train", "eval"):
        if cfg.data.get(key) is not None:
            try:
                load_prompts(cfg.data[key], f"data.{key}")
            except (OSError, ValueError) as error:
                raise ConfigError(str(error)) from None
    return cfg
