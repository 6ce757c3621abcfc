"""Rules across config groups, checked after composition and before any model loads.

`validate` refuses a mandatory value left unset and a key no schema has, converts the
composed config once into the schema objects (`TrainConfig` and its dataclasses, enums for
closed sets), fills what other groups leave to the model family (resolution, guidance, LoRA
targets; float32 for full fine-tuning, `model.lora=null`), types each reward's options,
checks every rule (each error names the keys involved; an engine to attach to must answer)
and returns the config the run uses. The engine's own rules are its module's `check_config`
(omni/rollout/<engine>_engine.py), the algorithm's its class's `check_config`, and the memory
estimate against the device (and `model.fsdp.version=null`'s choice) is omni/memory.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from omni.algorithms import get_algorithm
from omni.checkpoint import CheckpointMismatch, DamagedCheckpoint, check_checkpoint, check_lora_file
from omni.config import TrainConfig
from omni.config.errors import ConfigError, require
from omni.config.model import DType
from omni.data.prompts import load_prompts
from omni.memory import check_memory, resolve_fsdp_version
from omni.models import get_family
from omni.models.base import ModelFamily
from omni.rewards import REWARDS, reward_options
from omni.rollout import ENGINES, engine_name, shares_actor

__all__ = ["ConfigError", "validate"]


def _lookup(getter, *args):
    """A registry lookup whose unknown name becomes a ConfigError (the message names the key)."""
    try:
        return getter(*args)
    except KeyError as error:
        raise ConfigError(error.args[0]) from None


def check_model(model) -> ModelFamily:
    family = _lookup(get_family, model.family)
    if model.tiny_seed is None:
        check_not_hub_id(model.path)
        try:
            family.check_path(model.path, "model.path")
        except (OSError, ValueError) as error:
            raise ConfigError(str(error)) from None
    else:
        require(
            model.path is None,
            f"model.path={model.path} is set but model.tiny_seed={model.tiny_seed} chooses the tiny random model; "
            f"unset one of them (model=<family> for a checkpoint, model=<family>_tiny for the tiny model)",
        )
    prefixes = list(model.fsdp.layer_prefixes)
    containers = list(family.layer_prefixes)
    require(len(prefixes) > 0, f"model.fsdp.layer_prefixes is empty; {family.name} blocks are under {containers}")
    for prefix in prefixes:
        require(
            prefix in containers,
            f"model.fsdp.layer_prefixes: '{prefix}' names no block container of {family.name}; its blocks are under {containers}",
        )
    require(
        model.fsdp.version in (None, 0, 1, 2),
        f"model.fsdp.version={model.fsdp.version}: expected 0, 1, 2 or null (replicated where the base fits, else 2)",
    )
    require(
        model.vae_inversion_steps >= 0,
        f"model.vae_inversion_steps={model.vae_inversion_steps} must be >= 0 (0: the VAE's encoder)",
    )
    if model.lora is not None:
        require(model.lora.rank > 0, f"model.lora.rank={model.lora.rank} must be positive")
        require(bool(model.lora.adapter_name), "model.lora.adapter_name must not be empty")
        require(len(model.lora.target_modules) > 0, "model.lora.target_modules is empty")
        check_lora_targets(model, family)
        if model.lora.init_from is not None:
            try:
                check_lora_file(Path(model.lora.init_from), model.lora)
            except (OSError, DamagedCheckpoint, CheckpointMismatch) as error:
                raise ConfigError(f"model.lora.init_from={model.lora.init_from}: {error}") from None
    return family


def check_not_hub_id(path) -> None:
    """A Hugging Face hub id (owner/name, no such local directory) given as model.path."""
    if not path or Path(path).expanduser().exists() or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path)):
        return
    local = f"/ckpt/{str(path).split('/')[-1]}"
    raise ConfigError(
        f"model.path={path}: no such local directory; it looks like a Hugging Face hub id, but models load from "
        f"local directories: download it once (huggingface-cli download {path} --local-dir {local}) and pass "
        f"model.path={local}"
    )


def check_lora_targets(model, family: ModelFamily) -> None:
    """Every LoRA target names modules of the transformer, found from its config on the meta
    device (no weights read)."""
    names = family.module_names(model.path if model.tiny_seed is None else None)
    names = [n for n in names if not any(n == x or n.endswith("." + x) for x in model.lora.exclude_modules)]
    unmatched = [t for t in model.lora.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
    require(
        not unmatched,
        f"model.lora.target_modules: {unmatched} match no module of the {family.name} transformer; "
        f"module names end in e.g. {[n for n in leaves if not n.isdigit()][:20]}",
    )


def check_rollout(cfg: TrainConfig, family: ModelFamily) -> None:
    rollout, model = cfg.rollout, cfg.model
    engine_check = getattr(ENGINES.module(engine_name(cfg)), "check_config", None)
    if engine_check is not None:  # the engine's own rules (rollout=vllm: a family it serves, an engine to reach)
        engine_check(cfg, family)
    multiple = (
        family.tiny_resolution_multiple() if model.tiny_seed is not None else family.resolution_multiple(model.path)
    )
    require(
        rollout.resolution > 0 and rollout.resolution % multiple == 0,
        f"rollout.resolution={rollout.resolution}: this model takes multiples of {multiple} (VAE factor x patch size)",
    )
    require(rollout.fps > 0, f"rollout.fps={rollout.fps} must be positive")
    require(
        family.video or rollout.num_frames == 1,
        f"rollout.num_frames={rollout.num_frames}: model.family={family.name} makes images (1 frame); frames are for video models",
    )
    require(
        rollout.guidance_scale >= 0, f"rollout.guidance_scale={rollout.guidance_scale} must be >= 0 (1 or less: no CFG)"
    )
    check_share_actor(cfg)
    check_shared_actor_options(cfg)
    check_full_finetuning_sync(cfg)
    require(
        not (rollout.layered_summon and not rollout.load_base),
        "rollout.layered_summon=true needs the base weights already in the engine, but "
        "rollout.load_base=false starts it without them; set rollout.load_base=true or layered_summon=false",
    )
    check_family_settings(cfg, family)


def check_family_settings(cfg: TrainConfig, family: ModelFamily) -> None:
    """The family's own rules (a guidance it does not take, a text length its encoder
    cannot), from the transformer's config: no weights read. Modules the family's output
    never depends on join `model.lora.exclude_modules`."""
    model = cfg.model
    config = family.tiny_transformer_config() if model.tiny_seed is not None else family.transformer_config(model.path)
    try:
        family.check_settings(config, model, cfg.rollout)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model.lora is not None:
        unused = [name for name in family.unused_modules(config) if name not in model.lora.exclude_modules]
        model.lora.exclude_modules = [*model.lora.exclude_modules, *unused]


def check_share_actor(cfg: TrainConfig) -> None:
    if not cfg.rollout.share_actor:
        return
    require(
        hasattr(ENGINES.module(engine_name(cfg)), "can_share_actor"),
        f"rollout.share_actor=true with rollout.engine={engine_name(cfg)}: only an in-process engine "
        "(diffusers) can sample with the actor's transformer; set rollout.share_actor=false",
    )
    require(
        cfg.trainer.n_workers == 1 or cfg.model.fsdp.version in (0, 2),
        f"rollout.share_actor=true with model.fsdp.version={cfg.model.fsdp.version} and trainer.n_workers="
        f"{cfg.trainer.n_workers}: a shared transformer is gathered for sampling with FSDP2 only; "
        "set model.fsdp.version=2 (or 0, a replicated base) or rollout.share_actor=false",
    )


def check_shared_actor_options(cfg: TrainConfig) -> None:
    """An engine sampling with the actor's transformer (`shares_actor`, LoRA or full
    fine-tuning alike) loads no copy of its own and is never synced: the options of its own
    copy and of the sync would do nothing."""
    rollout = cfg.rollout
    if not shares_actor(cfg):
        return
    shared = (
        f"a shared actor (rollout.share_actor={'true' if rollout.share_actor else 'null, shared where possible'}: "
        f"rollout.engine=diffusers, trainer.n_workers={cfg.trainer.n_workers}"
        f"{', model.lora=null (full fine-tuning)' if cfg.model.lora is None else ''})"
    )
    own_copy = "or rollout.share_actor=false for an engine with a transformer of its own"
    require(
        not rollout.layered_summon,
        f"rollout.layered_summon=true with {shared}: the engine samples with the actor's own transformer and is "
        f"never synced, so nothing is summoned layer by layer; set rollout.layered_summon=false, {own_copy}",
    )
    require(
        rollout.load_base,
        f"rollout.load_base=false with {shared}: the engine loads no transformer of its own, so there is no base "
        f"to leave out; drop rollout.load_base=false, {own_copy}",
    )


def check_full_finetuning_sync(cfg: TrainConfig) -> None:
    """Full fine-tuning (`model.lora=null`) sends the whole transformer at every sync; the
    layered walk syncs only a LoRA onto a base already in the engine."""
    rollout = cfg.rollout
    if cfg.model.lora is not None or not rollout.layered_summon or shares_actor(cfg):
        return  # an engine sampling with the actor is never synced (check_shared_actor_options)
    raise ConfigError(
        "rollout.layered_summon=true with model.lora=null (full fine-tuning): the layered sync sends only a LoRA "
        "onto the base already in the engine, but with full fine-tuning every sync sends the whole new transformer "
        f"(here rollout.load_base={str(rollout.load_base).lower()}, rollout.share_actor={str(shares_actor(cfg)).lower()}); "
        "set rollout.layered_summon=false, or train a LoRA (model.lora.rank=...)"
    )


def check_full_finetuning(cfg: TrainConfig) -> None:
    """What full fine-tuning (`model.lora=null`) does not do: compute below fp32 (the trained
    transformer is its own master copy), or keep an EMA (the average is of a LoRA)."""
    if cfg.model.lora is not None:
        return
    require(
        cfg.model.dtype == DType.float32,
        f"model.lora=null (full fine-tuning) with model.dtype={cfg.model.dtype.value}: the whole transformer trains "
        "and is its own master copy, kept in float32; set model.dtype=float32 (or auto), or train a LoRA",
    )
    require(
        cfg.trainer.ema_decay is None,
        f"trainer.ema_decay={cfg.trainer.ema_decay} with model.lora=null (full fine-tuning): the EMA averages a LoRA; "
        "set trainer.ema_decay=null, or train a LoRA",
    )


def check_trainer(cfg: TrainConfig) -> None:
    trainer = cfg.trainer
    require(
        trainer.eval_only or trainer.steps >= 1,
        f"trainer.steps={trainer.steps}: a run trains at least 1 step; to only evaluate, set trainer.eval_only=true",
    )
    require(
        trainer.ema_decay is None or 0 < trainer.ema_decay < 1,
        f"trainer.ema_decay={trainer.ema_decay} must be in (0, 1) (the weight of the previous average), or null for no EMA",
    )
    require(trainer.max_bad_steps >= 1, f"trainer.max_bad_steps={trainer.max_bad_steps} must be >= 1")
    require(
        trainer.keep_last_checkpoints is None or trainer.keep_last_checkpoints >= 1,
        f"trainer.keep_last_checkpoints={trainer.keep_last_checkpoints} must be >= 1, or null to keep every checkpoint",
    )
    require(trainer.lr > 0, f"trainer.lr={trainer.lr} must be positive")
    require(
        trainer.eval_only or 0 <= trainer.warmup_steps < trainer.steps,
        f"trainer.warmup_steps={trainer.warmup_steps} must be in [0, trainer.steps={trainer.steps})",
    )
    require(trainer.batch_size > 0, f"trainer.batch_size={trainer.batch_size} must be positive")
    require(trainer.micro_batch_size > 0, f"trainer.micro_batch_size={trainer.micro_batch_size} must be positive")
    require(trainer.max_grad_norm >= 0, f"trainer.max_grad_norm={trainer.max_grad_norm} must be >= 0")
    require(
        trainer.eval_images_per_prompt > 0,
        f"trainer.eval_images_per_prompt={trainer.eval_images_per_prompt} must be positive",
    )
    require(trainer.n_workers >= 1, f"trainer.n_workers={trainer.n_workers} must be >= 1")
    require(
        trainer.batch_size % trainer.n_workers == 0,
        f"trainer.batch_size={trainer.batch_size} does not split evenly over trainer.n_workers={trainer.n_workers}",
    )
    if trainer.resume not in (None, "auto"):
        require(Path(trainer.resume).is_dir(), f"trainer.resume={trainer.resume}: no such checkpoint directory")
        try:
            check_checkpoint(Path(trainer.resume), cfg.model)
        except (DamagedCheckpoint, CheckpointMismatch) as error:
            raise ConfigError(f"trainer.resume={trainer.resume}: {error}") from None
    check_workers(cfg)


def check_workers(cfg: TrainConfig) -> None:
    """Workers, nodes and GPUs that describe one layout (see omni.workers.ray_cluster), and
    a sharded actor whenever there is more than one worker."""
    trainer = cfg.trainer
    workers, nodes, gpus = trainer.n_workers, trainer.nnodes, trainer.n_gpus_per_node
    require(nodes >= 1 and gpus >= 0, f"trainer.nnodes={nodes} must be >= 1 and trainer.n_gpus_per_node={gpus} >= 0")
    if gpus > 0:
        require(
            workers == nodes * gpus,
            f"trainer.n_workers={workers}: one worker per GPU, so trainer.nnodes={nodes} x "
            f"trainer.n_gpus_per_node={gpus} = {nodes * gpus}; set trainer.n_workers={nodes * gpus}",
        )
        require(trainer.device != "cpu", f"trainer.device=cpu but trainer.n_gpus_per_node={gpus}; set one of them")
    else:
        require(workers % nodes == 0, f"trainer.n_workers={workers} does not split evenly over trainer.nnodes={nodes}")
        require(
            workers == 1 or trainer.device != "cuda",
            f"trainer.device=cuda with trainer.n_gpus_per_node=0: Ray gives the {workers} workers no GPU; "
            f"set trainer.n_gpus_per_node",
        )
    require(
        trainer.ray_address is None or workers > 1,
        f"trainer.ray_address={trainer.ray_address} with trainer.n_workers=1: one worker runs in this process "
        f"without Ray; set trainer.n_workers > 1 to use the cluster",
    )
    require(
        trainer.placement_timeout_s > 0, f"trainer.placement_timeout_s={trainer.placement_timeout_s} must be positive"
    )


def check_logger(logger, family: ModelFamily) -> None:
    """Cadences; each chosen backend is installed; a video model's logged clips are mp4
    files, whose encoder must be installed."""
    from omni.loggers import missing_backends

    missing = missing_backends([backend.value for backend in logger.backends])
    require(
        not missing,
        "; ".join(f"logger.backends has {name}, which is not installed: {fix}" for name, fix in missing.items()),
    )
    require(logger.console_every >= 1, f"logger.console_every={logger.console_every} must be >= 1")
    require(logger.image_every >= 0, f"logger.image_every={logger.image_every} must be >= 0")
    if family.video and logger.image_every:
        from omni.videos import video_backend_missing

        missing = video_backend_missing()
        require(
            not missing,
            f"logger.image_every={logger.image_every} logs model.family={family.name}'s clips as videos: {missing}",
        )


def check_rewards(reward) -> None:
    """Types each component's options in place (`reward.components.<name>`) and checks them
    (files that must exist), loading nothing."""
    require(bool(reward.components), "reward.components is empty: name at least one reward")
    require(reward.batch_size > 0, f"reward.batch_size={reward.batch_size} must be positive")
    for name in list(reward.components):
        try:
            reward.components[name] = reward_options(name, reward.components[name])
            REWARDS.get(name).check_options(reward.components[name], f"reward.components.{name}")
        except (KeyError, ValueError) as error:
            raise ConfigError(error.args[0]) from None
    for name, options in reward.components.items():
        require(
            math.isfinite(options.weight),
            f"reward.components.{name}.weight={options.weight}: a weight must be a finite number",
        )
    weights = {f"reward.components.{n}.weight": o.weight for n, o in reward.components.items()}
    require(
        any(weight != 0 for weight in weights.values()),
        f"reward.components: every weight is 0 ({', '.join(f'{k}={w}' for k, w in weights.items())}), so the reward is 0",
    )
    require(
        abs(sum(weights.values())) > 1e-9 * max(abs(w) for w in weights.values()),
        f"reward.components: the weights sum to 0 ({' + '.join(f'{k}={w}' for k, w in weights.items())}); "
        "give weights with a nonzero total (e.g. summing to 1)",
    )


def check_reward_kinds(reward, family: ModelFamily) -> None:
    """Clip rewards for a video model, image rewards for an image model."""
    for name in reward.components:
        takes_video = REWARDS.get(name).video
        if family.video:
            require(
                takes_video,
                f"reward.components.{name} scores images but model.family={family.name} makes videos: score each frame "
                f"and average with reward.components.frame_average.image={name} (e.g. reward=frame_brightness)",
            )
        else:
            require(
                not takes_video, f"reward.components.{name} scores videos but model.family={family.name} makes images"
            )


def check_prompts(data, reward) -> None:
    """Each prompt file loads, and each prompt has what every reward component needs of it
    (the OCR target text, GenEval's objects): the first that lacks it is named, with its line."""
    for key in ("train", "eval"):
        spec = getattr(data, key)
        if spec is None:
            continue
        try:
            prompts = load_prompts(spec, f"data.{key}", data.skip_bad_rows)
        except (OSError, ValueError) as error:
            raise ConfigError(str(error)) from None
        for name, options in reward.components.items():
            component = REWARDS.get(name)
            for prompt in prompts:
                problem = component.prompt_problem(options, prompt)
                require(
                    problem is None,
                    f"data.{key}={spec}: {prompt.origin}: reward.components.{name} needs {problem}; the prompt is {str(prompt)[:100]!r}",
                )


def to_schema(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The schema objects of a composed config (a copy: the caller's config is untouched).
    Refuses first a mandatory value left unset and a key no schema has (one appended with
    `+key=value` gets past Hydra's own check), naming each."""
    if isinstance(cfg, TrainConfig):
        return copy.deepcopy(cfg)
    missing = sorted(OmegaConf.missing_keys(cfg))
    require(
        not missing,
        "; ".join(f"{key} is mandatory and not set: {field_hint(cfg, key) or f'pass {key}=...'}" for key in missing),
    )
    unknown = unknown_keys(cfg)
    require(
        not unknown,
        "; ".join(
            f"{key}: no such key (the schema of {parent or 'the run'} has {', '.join(known)})"
            for key, parent, known in unknown
        )
        + "; a key appended with +key=value must still be one the schema has",
    )
    try:
        return OmegaConf.to_object(cfg)
    except Exception as error:  # a failing interpolation, named by OmegaConf
        raise ConfigError(str(error)) from None


def field_hint(cfg: DictConfig, key: str) -> str | None:
    """What to pass for a mandatory `key`: the `hint` metadata of its field in the schema
    dataclass of its parent node (a group's, or a reward's options), if any."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else cfg
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if not dataclasses.is_dataclass(schema):
        return None
    field = {f.name: f for f in dataclasses.fields(schema)}.get(name)
    return None if field is None else field.metadata.get("hint")


def unknown_keys(node: DictConfig, prefix: str = "") -> list:
    """(key, its parent, the parent's schema keys) for each key of the composed config that
    its schema dataclass lacks; an untyped mapping (reward.components) is typed at validation."""
    schema = OmegaConf.get_type(node)
    known = sorted(f.name for f in dataclasses.fields(schema)) if dataclasses.is_dataclass(schema) else None
    found = []
    for key in node.keys():
        child = node._get_node(key)
        if known is not None and key not in known:
            found.append((f"{prefix}{key}", prefix.rstrip("."), known))
        elif isinstance(child, DictConfig) and not (
            child._is_none() or child._is_missing() or child._is_interpolation()
        ):
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def resolve(cfg: TrainConfig, family: ModelFamily) -> None:
    """Fill in the model family's native values where the other groups left None."""
    if cfg.rollout.resolution is None:
        cfg.rollout.resolution = cfg.model.resolution
    if cfg.rollout.guidance_scale is None:
        cfg.rollout.guidance_scale = cfg.model.guidance_scale
    if cfg.rollout.num_frames is None:
        cfg.rollout.num_frames = cfg.model.num_frames
    if cfg.rollout.fps is None:
        cfg.rollout.fps = cfg.model.fps
    lora = cfg.model.lora
    if lora is not None and lora.target_modules is None:
        lora.target_modules = list(family.lora_targets)
    if lora is None and cfg.model.dtype == DType.auto:
        cfg.model.dtype = DType.float32  # full fine-tuning trains fp32 weights (see check_full_finetuning)


def validate(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """Check every cross-group rule; returns the typed, resolved config. Loads no model."""
    cfg = to_schema(cfg)
    family = _lookup(get_family, cfg.model.family)
    resolve(cfg, family)
    check_model(cfg.model)
    resolve_fsdp_version(cfg, family)
    check_rollout(cfg, family)
    check_trainer(cfg)
    check_full_finetuning(cfg)
    check_memory(cfg, family)
    _lookup(get_algorithm, cfg.algorithm.name).check_config(cfg)
    check_logger(cfg.logger, family)
    check_rewards(cfg.reward)
    check_reward_kinds(cfg.reward, family)
    check_prompts(cfg.data, cfg.reward)
    return cfg
