"""Rules across config groups, checked after composition and before any model loads.

`validate` refuses a mandatory value left unset and a key no schema has, converts the
composed config once into the schema objects (`TrainConfig` and its dataclasses, enums for
closed sets; each group's rules on its own fields run there, in its `__post_init__`),
checks that the model's weights can be read, then runs two phases: `resolve` fills what
other groups leave to the model family (resolution, guidance, LoRA targets and the modules
to leave out; float32 for full fine-tuning, `model.lora=null`; the FSDP version), and
`check` refuses installed dependency versions known to break a path the run takes
(omni/known_bad.py), types each reward's options (and the sentinel's gold rewards,
omni/sentinel.py's `check_config`) and checks every rule across groups (each error names
the keys involved; an engine to attach to must answer). It returns the config the run
uses. The engine's own rules are its module's `check_config`
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
from omni.algorithms.base import check_initial_noise
from omni.async_rollout import check_config as check_async
from omni.checkpoint import CheckpointMismatch, DamagedCheckpoint, check_checkpoint, check_lora_file
from omni.config import TrainConfig
from omni.config.algorithm import AdvantageNorm
from omni.config.errors import ConfigError, require
from omni.config.eval import moved_key_message
from omni.config.model import DType
from omni.config.reward import Aggregation
from omni.data.prompt_sets import load_prompt_set
from omni.data.prompts import source_images
from omni.evaluation import prompt_source
from omni.known_bad import check_known_bad
from omni.memory import check_memory, resolve_fsdp_version
from omni.models import get_family
from omni.models.base import ModelFamily
from omni.rewards import REWARDS, reward_options
from omni.rollout import ENGINES, engine_name, shares_actor
from omni.sentinel import check_config as check_sentinel

__all__ = ["ConfigError", "validate"]


def _lookup(getter, *args):
    """A registry lookup whose unknown name becomes a ConfigError (the message names the key)."""
    try:
        return getter(*args)
    except KeyError as error:
        raise ConfigError(error.args[0]) from None


def check_source(model) -> ModelFamily:
    """The family exists and its weights can be read: a local checkpoint, or a tiny seed
    (what resolution reads the transformer's config from)."""
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
    return family


def check_model(model, family: ModelFamily) -> None:
    prefixes = list(model.fsdp.layer_prefixes)
    containers = list(family.layer_prefixes)
    require(len(prefixes) > 0, f"model.fsdp.layer_prefixes is empty; {family.name} blocks are under {containers}")
    for prefix in prefixes:
        require(
            prefix in containers,
            f"model.fsdp.layer_prefixes: '{prefix}' names no block container of {family.name}; "
            f"its blocks are under {containers}",
        )
    if model.lora is not None:
        check_lora_targets(model, family)
        if model.lora.init_from is not None:
            try:
                check_lora_file(Path(model.lora.init_from), model.lora)
            except (OSError, DamagedCheckpoint, CheckpointMismatch) as error:
                raise ConfigError(f"model.lora.init_from={model.lora.init_from}: {error}") from None


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


def peft_matches(name: str, keys) -> bool:
    """PEFT's rule for a module name and a list of target (or excluded) keys: the name is a
    key, or ends in `.<key>`."""
    return any(name == key or name.endswith(f".{key}") for key in keys)


def check_lora_targets(model, family: ModelFamily) -> None:
    """Every LoRA target names modules of the transformer, found from its config on the meta
    device (no weights read)."""
    names = family.module_names(model.path if model.tiny_seed is None else None)
    names = [n for n in names if not peft_matches(n, model.lora.exclude_modules)]
    unmatched = [t for t in model.lora.target_modules if not any(peft_matches(n, [t]) for n in names)]
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
    check_resolution("rollout.resolution", rollout.resolution, model, family)
    require(
        family.video or rollout.num_frames == 1,
        f"rollout.num_frames={rollout.num_frames}: model.family={family.name} makes images (1 frame); "
        "frames are for video models",
    )
    check_share_actor(cfg)
    check_shared_actor_options(cfg)
    check_full_finetuning_sync(cfg)
    check_family_settings(cfg, family)


def check_family_settings(cfg: TrainConfig, family: ModelFamily) -> None:
    """The family's own rules (a guidance it does not take, a text length its encoder
    cannot), from the transformer's config: no weights read; expert settings only for a
    family of experts."""
    from omni.config.model import EXPERTS

    model = cfg.model
    if not family.experts and (model.guidance_scale_2 is not None or sorted(model.train_experts) != sorted(EXPERTS)):
        key = "guidance_scale_2" if model.guidance_scale_2 is not None else "train_experts"
        raise ConfigError(
            f"model.{key}={getattr(model, key)}: model.family={family.name} has one transformer, no experts "
            "(model=wan22 has two)"
        )
    try:
        family.check_settings(transformer_config(cfg.model, family), cfg.model, cfg.rollout)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def transformer_config(model, family: ModelFamily) -> dict:
    """The transformer's config (no weights read): the tiny model's or the checkpoint's."""
    return family.tiny_transformer_config() if model.tiny_seed is not None else family.transformer_config(model.path)


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
        f"(here rollout.load_base={str(rollout.load_base).lower()}, "
        f"rollout.share_actor={str(shares_actor(cfg)).lower()}); "
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


def check_resume(trainer, model) -> None:
    """A checkpoint to continue from exists, is intact and matches the model's LoRA."""
    if trainer.resume in (None, "auto"):
        return
    require(Path(trainer.resume).is_dir(), f"trainer.resume={trainer.resume}: no such checkpoint directory")
    try:
        check_checkpoint(Path(trainer.resume), model)
    except (DamagedCheckpoint, CheckpointMismatch) as error:
        raise ConfigError(f"trainer.resume={trainer.resume}: {error}") from None


def check_logger(logger, family: ModelFamily) -> None:
    """Each chosen backend is installed; a video model's logged clips are mp4
    files, whose encoder must be installed."""
    from omni.loggers import missing_backends

    missing = missing_backends([backend.value for backend in logger.backends])
    require(
        not missing,
        "; ".join(f"logger.backends has {name}, which is not installed: {fix}" for name, fix in missing.items()),
    )
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
        f"reward.components: every weight is 0 ({', '.join(f'{k}={w}' for k, w in weights.items())}), "
        "so the reward is 0",
    )
    require(
        abs(sum(weights.values())) > 1e-9 * max(abs(w) for w in weights.values()),
        f"reward.components: the weights sum to 0 ({' + '.join(f'{k}={w}' for k, w in weights.items())}); "
        "give weights with a nonzero total (e.g. summing to 1)",
    )


def check_aggregation(cfg: TrainConfig) -> None:
    """GDPO normalises each reward within its prompt's group: it needs several rewards that
    count and an algorithm that samples groups, and a per-reward normalisation that removes
    each reward's scale."""
    reward, algo = cfg.reward, cfg.algorithm
    if Aggregation(reward.aggregation) != Aggregation.gdpo:
        return
    weighted = [name for name, options in reward.components.items() if options.weight != 0]
    require(
        len(weighted) >= 2,
        f"reward.aggregation=gdpo normalises each reward apart, but reward.components has "
        f"{len(weighted)} with a nonzero weight ({', '.join(weighted) or 'none'}); name two or more "
        "(e.g. reward=multi), or leave reward.aggregation=weighted_sum",
    )
    require(
        hasattr(algo, "group_size"),
        f"reward.aggregation=gdpo normalises each reward within its prompt's group, but algorithm={algo.name} "
        "samples no groups (it has no algorithm.group_size); leave reward.aggregation=weighted_sum",
    )
    require(
        getattr(algo, "adv_norm", None) != AdvantageNorm["none"],
        "reward.aggregation=gdpo with algorithm.adv_norm=none: each reward would keep its own scale "
        "before the sum, which GDPO removes; set algorithm.adv_norm=group (GDPO's) or global",
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


def check_prompts(cfg: TrainConfig, family: ModelFamily) -> None:
    """Each prompt file loads, its prompts are edits exactly when the family edits (within its
    number of sources), each prompt has what every reward component needs of it (the OCR
    target text, GenEval's objects, an edit's target), and each evaluation prompt what
    `eval.rewards` need: the first that lacks it is named, with its line."""
    data, components = cfg.data, cfg.reward.components
    extra = {name: reward_options(name, {}, "eval.rewards") for name in cfg.eval.rewards if name not in components}
    _, eval_key = prompt_source(cfg)
    for spec, key in ((data.train, "data.train"), (data.eval, "data.eval"), (cfg.eval.prompts, "eval.prompts")):
        if spec is None:
            continue
        try:
            prompts = load_prompt_set(spec, key, data.skip_bad_rows)
        except (OSError, ValueError) as error:
            raise ConfigError(str(error)) from None
        eval_resolution = cfg.eval.resolution or cfg.rollout.resolution
        sizes = {cfg.rollout.resolution} if key == "data.train" else set()
        sizes |= {eval_resolution} if key == eval_key else set()
        for prompt in prompts:
            check_sources(prompt, f"{key}={spec}", family)
            for resolution in sorted(sizes):
                problem = family.source_problem(prompt, resolution)
                require(problem is None, f"{key}={spec}: {prompt.origin}: {problem}")
        problem = family.sources_problem(prompts)
        require(problem is None, f"{key}={spec}: {problem}")
        needs = [("reward.components", components)] + ([("eval.rewards", extra)] if key == eval_key else [])
        for where, rewards in needs:
            for name, options in rewards.items():
                component = REWARDS.get(name)
                for prompt in prompts:
                    problem = component.prompt_problem(options, prompt)
                    require(
                        problem is None,
                        f"{key}={spec}: {prompt.origin}: {where}.{name} needs {problem}; "
                        f"the prompt is {str(prompt)[:100]!r}",
                    )


def check_sources(prompt, where: str, family: ModelFamily) -> None:
    """An edit family's prompt has between one and `family.max_source_images` source images,
    a text-to-image family's none."""
    count = len(source_images(prompt))
    at = f"{where}: {prompt.origin}" if getattr(prompt, "origin", "") else where
    if family.edit:
        require(
            1 <= count <= family.max_source_images,
            f"{at}: model.family={family.name} edits images and takes 1 to {family.max_source_images} source "
            f"image(s) a prompt; this one has {count} (an edit set row names them in 'image' or 'images': "
            "omni/data/edits.py)",
        )
    else:
        require(
            count == 0,
            f"{at}: the prompt has source images but model.family={family.name} makes images from text; "
            "train an edit family on edit data (e.g. model=flux_kontext_tiny)",
        )


def check_eval(cfg: TrainConfig, family: ModelFamily) -> None:
    """The evaluation's rewards exist, take the family's kind of output and their default
    options, and its resolution is one the model takes (its prompts: `check_prompts`)."""
    for name in cfg.eval.rewards:
        require(name in REWARDS.names(), f"eval.rewards: '{name}' is no reward; available: {REWARDS.names()}")
        try:
            REWARDS.get(name).check_options(reward_options(name, {}, "eval.rewards"), f"eval.rewards.{name}")
        except (KeyError, ValueError) as error:
            raise ConfigError(f"{error.args[0]} (eval.rewards scores with each reward's default options)") from None
        require(
            REWARDS.get(name).video == family.video,
            f"eval.rewards: '{name}' scores {'clips' if REWARDS.get(name).video else 'images'} but "
            f"model.family={family.name} makes {'clips' if family.video else 'images'}",
        )
    check_resolution("eval.resolution", cfg.eval.resolution, cfg.model, family)


def check_resolution(key: str, resolution: int, model, family: ModelFamily) -> None:
    """`resolution` (the value of `key`) is positive and one the model takes."""
    multiple = (
        family.tiny_resolution_multiple() if model.tiny_seed is not None else family.resolution_multiple(model.path)
    )
    require(
        resolution > 0 and resolution % multiple == 0,
        f"{key}={resolution}: this model takes multiples of {multiple} (VAE factor x patch size)",
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
    moved = [moved_key_message(key) for key, _, _ in unknown if moved_key_message(key)]
    require(not moved, "; ".join(moved))
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
    """Phase one: fill in what the groups left null. The model family's native values
    (resolution, guidance, frames, fps; the evaluation's sampler takes the rollout's), its
    LoRA targets, the modules its output never depends on (joining `model.lora.exclude_modules`),
    float32 for full fine-tuning, and `model.fsdp.version=null`'s choice (omni/memory.py)."""
    rollout, model = cfg.rollout, cfg.model
    if rollout.resolution is None:
        rollout.resolution = model.resolution
    if rollout.guidance_scale is None:
        rollout.guidance_scale = model.guidance_scale
    if rollout.num_frames is None:
        rollout.num_frames = model.num_frames
    if rollout.fps is None:
        rollout.fps = model.fps
    evaluation = cfg.eval  # the evaluation's sampler: the rollout's where it says nothing
    for key, value in (("steps", rollout.num_steps), ("guidance_scale", rollout.guidance_scale)):
        if getattr(evaluation, key) is None:
            setattr(evaluation, key, value)
    if evaluation.resolution is None:
        evaluation.resolution = rollout.resolution
    lora = model.lora
    if lora is not None:
        if lora.target_modules is None:
            lora.target_modules = list(family.lora_targets)
        unused = family.unused_modules(transformer_config(model, family))
        # only those a target matches: PEFT warns of an exclusion that excludes nothing
        unused = [name for name in unused if peft_matches(name, lora.target_modules)]
        lora.exclude_modules = [*lora.exclude_modules, *(name for name in unused if name not in lora.exclude_modules)]
    if lora is None and model.dtype == DType.auto:
        model.dtype = DType.float32  # full fine-tuning trains fp32 weights (see check_full_finetuning)
    resolve_fsdp_version(cfg, family)


def check(cfg: TrainConfig, family: ModelFamily) -> None:
    """Phase two: every rule across groups, on the resolved config (each group's own rules
    ran when its schema object was built: `__post_init__` in omni/config/). First, installed
    dependency versions known to break a path the run takes (omni/known_bad.py)."""
    check_known_bad(cfg)
    check_model(cfg.model, family)
    algorithm = _lookup(get_algorithm, cfg.algorithm.name)
    check_async(cfg, algorithm)  # before the engine's own checks, which may probe a server
    check_initial_noise(cfg, algorithm)
    check_rollout(cfg, family)
    check_resume(cfg.trainer, cfg.model)
    check_full_finetuning(cfg)
    check_memory(cfg, family)
    algorithm.check_config(cfg)
    check_logger(cfg.logger, family)
    check_rewards(cfg.reward)
    check_aggregation(cfg)
    check_reward_kinds(cfg.reward, family)
    check_eval(cfg, family)
    check_prompts(cfg, family)
    check_sentinel(cfg, family)


def validate(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The typed, resolved and checked config the run uses; loads no model. Its schema
    objects are built (each group's own rules), the source of the weights checked, then
    `resolve` and `check`, the two phases."""
    cfg = to_schema(cfg)
    family = check_source(cfg.model)
    resolve(cfg, family)
    check(cfg, family)
    return cfg
