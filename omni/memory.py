"""Will it fit? Per-device memory of a training run, estimated from its architecture alone.

Builds the REAL transformer on the meta device from its published config (shipped in
omni/models/configs/, or a checkpoint's own transformer/config.json): no weight is read or
allocated. It counts the transformer's weights, the LoRA the run puts on it and the
optimizer state, and estimates activations. `scripts/estimate_memory.py` prints the
estimate for several architectures and resolutions; validation (`trainer.device_memory_gib`)
refuses a run whose own settings exceed the device before any model loads (`check_memory`,
and `resolve_fsdp_version` for `model.fsdp.version=null`, both called by omni.validation).

What is counted, per device: the actor's weights (sharded over the workers by FSDP, plus the
two blocks it gathers at a time), the LoRA's fp32 masters, gradients and AdamW state
(sharded too), the transformer gathered whole for the rollout (or the engine's own copy
with rollout.share_actor=false), the text encoders (on the device only while encoding with
rollout.offload_text_encoders) and the VAE; activations of one micro-batch's forward and
backward (doubled by true CFG), as 34 bytes per token per hidden unit per block without
checkpointing (Korthikanti et al. 2022's count for a block with memory-efficient attention)
or the block inputs plus one block's with it. The peak is the largest of a step's phases
(training, the rollout, prompt encoding). It is an estimate: allocator fragmentation and
temporary buffers come on top (leave ~10%). Full fine-tuning (`model.lora=null`) is not
estimated yet.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omni.config.errors import ConfigError, require
from omni.config.model import DType
from omni.rollout import shares_actor

if TYPE_CHECKING:
    from omni.config import TrainConfig
    from omni.models.base import ModelFamily

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class DoesNotFit(ValueError):
    """An estimate above the memory a device has."""


def arch_config(family, name_or_path: str) -> dict:
    """The transformer config of a published architecture of `family` (by name) or of a
    checkpoint directory."""
    if name_or_path in family.published_configs:
        return json.loads(
            (resources.files("omni") / "models" / "configs" / family.published_configs[name_or_path]).read_text()
        )
    return json.loads((Path(name_or_path).expanduser() / "transformer" / "config.json").read_text())


def count(family, config: dict, lora) -> dict:
    """Parameters of the transformer (every expert of a family of experts: all are resident),
    of its largest block, and of the LoRA `lora` puts on it; `blocks` are those one pass runs
    (one expert's)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from omni.weights import peft_lora_config

    model = family.meta_transformer(config=config)
    blocks = [block for prefix in family.layer_prefixes for block in model.get_submodule(prefix.rstrip(".")).children()]
    peft_config = peft_lora_config(lora)
    lora_params = sum(
        lora.rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and check_target_module_exists(peft_config, name)
    )
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "block_params": max(sum(p.numel() for p in b.parameters()) for b in blocks),
        "lora_params": lora_params,
        "hidden": config["num_attention_heads"] * config["attention_head_dim"],
        "blocks": len(blocks) // max(1, len(family.experts)),
        "experts": max(1, len(family.experts)),
        "text_encoder_params": family.text_encoder_params,
        "vae_params": family.vae_params,
    }


def estimate(
    sizes: dict,
    tokens: int,
    micro_batch: int,
    workers: int,
    fsdp: int,
    dtype: str,
    passes: int,
    checkpointing: bool,
    shared: bool = True,
    offload: bool = True,
) -> dict:
    """GiB per GPU of each part for `tokens` per image and `passes` transformer passes per
    image, and the peak over the phases of a step: training, the rollout (a shared actor is
    gathered whole for it; else the engine keeps its own copy) and prompt encoding (offloaded
    text encoders are on the device only then)."""
    width = BYTES[dtype]
    shards = workers if fsdp in (1, 2) and workers > 1 else 1
    batch = micro_batch * passes
    per_block = 34 * tokens * batch * sizes["hidden"] * width / 2  # 34 bytes per element at 2-byte width
    block_inputs = tokens * batch * sizes["hidden"] * width * sizes["blocks"]
    full = sizes["params"] * width
    parts = {
        "actor_weights": full / shards + (2 * sizes["block_params"] * width if shards > 1 else 0),
        "lora_weights_grads_adam": sizes["lora_params"] * 4 * 4 / shards,
        "engine_transformer": 0 if shared else full,
        "rollout_gathered_transformer": full - full / shards if shared else 0,
        "text_encoders": sizes["text_encoder_params"] * width,
        "vae": sizes["vae_params"] * 4,
        "activations": block_inputs + per_block if checkpointing else per_block * sizes["blocks"],
    }
    always = parts["actor_weights"] + parts["lora_weights_grads_adam"] + parts["engine_transformer"] + parts["vae"]
    always += 0 if offload else parts["text_encoders"]
    phases = {
        "train": always + parts["activations"],
        "rollout": always + parts["rollout_gathered_transformer"],
        "encode": always + (parts["text_encoders"] if offload else 0),
    }
    gib = {k: round(v / GIB, 2) for k, v in parts.items()}
    return {
        **gib,
        **{f"{k}_phase": round(v / GIB, 2) for k, v in phases.items()},
        "total": round(max(phases.values()) / GIB, 2),
    }


def run_settings(cfg, family, dtype: str) -> dict:
    """The estimate's settings (all but the resolution and frames) of a run's config, composed
    or validated, computing in `dtype`. Sharding left to the run (`model.fsdp.version=null`) is
    estimated as FSDP2, what the run takes where a replicated base does not fit."""
    guidance = cfg.rollout.guidance_scale if cfg.rollout.guidance_scale is not None else cfg.model.guidance_scale
    fsdp = 2 if cfg.model.fsdp.version is None else cfg.model.fsdp.version
    return dict(micro_batch=cfg.trainer.micro_batch_size, workers=cfg.trainer.n_workers, fsdp=fsdp,
                dtype=dtype, passes=family.forward_passes(guidance), checkpointing=cfg.model.gradient_checkpointing,
                shared=shares_actor(cfg), offload=cfg.rollout.offload_text_encoders)  # fmt: skip


def configuration(
    family, config: dict, sizes: dict, arch: str, resolution, num_frames: int, max_sequence_length: int, **settings
) -> dict:
    """The estimate of one configuration of architecture `arch` (its transformer `config`,
    counted as `sizes`): `resolution` pixels square or (height, width), `num_frames` per clip
    (1 for an image family) and `settings` as `run_settings` gives them. A family of experts
    (Wan2.2 A14B) holds all of them resident (`params` counts every one; `experts` gives each's)
    and runs one per step (the activations are one expert's)."""
    clip = {"num_frames": num_frames} if family.video else {}
    tokens = family.sequence_length(config, resolution, max_sequence_length, **clip)
    experts = sizes.get("experts", 1)
    per_expert = (
        {"experts": {"resident": experts, "params_each": sizes["params"] // experts, "running_per_step": 1}}
        if experts > 1
        else {}
    )
    return {
        "arch": arch,
        "params": sizes["params"],
        **per_expert,
        "lora_params": sizes["lora_params"],
        "resolution": resolution,
        "num_frames": num_frames,
        "tokens": tokens,
        **settings,
        "gib_per_gpu": estimate(sizes, tokens, **settings),
    }


def check_fits(results: list, gpu_memory: float, budget_name: str = "--gpu-memory") -> None:
    """Refuse (DoesNotFit) an architecture and resolution whose every estimate (with and
    without gradient checkpointing, as asked) exceeds `gpu_memory` GiB per GPU (given as
    `budget_name`), naming its frames and size."""
    best = {}
    for row in results:
        key = (row["arch"], str(row["resolution"]))
        if key not in best or row["gib_per_gpu"]["total"] < best[key]["gib_per_gpu"]["total"]:
            best[key] = row
    for row in best.values():
        if row["gib_per_gpu"]["total"] > gpu_memory:
            size = "x".join(map(str, row["resolution"])) if isinstance(row["resolution"], tuple) else row["resolution"]
            frames = f"rollout.num_frames={row['num_frames']} at " if row["num_frames"] > 1 else ""
            raise DoesNotFit(
                f"{row['arch']}: {frames}resolution {size} needs about {row['gib_per_gpu']['total']} GiB per GPU "
                f"(micro-batch {row['micro_batch']}, {row['workers']} workers, "
                f"gradient checkpointing {row['checkpointing']}), "
                f"more than {budget_name} {gpu_memory}: fewer frames, a smaller resolution or micro-batch, or more "
                "workers"
            )


def device_total_gib() -> float | None:
    """Total memory of this process's first CUDA device, in GiB; None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def peak_phase(row: dict) -> str:
    """The phase of a step (train, rollout, encode) whose memory is the estimate's peak."""
    gib = row["gib_per_gpu"]
    return max(("train", "rollout", "encode"), key=lambda phase: gib[f"{phase}_phase"])


# ------------------------------------------------- the run's estimate against its device (validation)
def runs_on_cuda(trainer) -> bool:
    """Whether the run's workers compute on CUDA devices (as omni.distributed.pick_device and
    the Ray worker group resolve trainer.device=auto)."""
    if trainer.device != "auto":
        return trainer.device == "cuda"
    return trainer.n_gpus_per_node > 0 or (trainer.n_workers == 1 and torch.cuda.is_available())


def memory_budget(trainer, on_cuda: bool) -> tuple:
    """GiB one device of the run may hold (`trainer.device_memory_gib`, else a CUDA device's
    total, else None: not checked) and how a message names it."""
    budget = trainer.device_memory_gib
    require(
        budget is None or budget >= 0.01,
        f"trainer.device_memory_gib={budget} must be at least 0.01 (GiB, the estimate's precision), or null for the "
        "CUDA device's total",
    )
    if budget is not None:
        return budget, f"trainer.device_memory_gib={budget}"
    total = device_total_gib() if on_cuda else None
    return total, f"the CUDA device's {total:.1f} GiB (trainer.device_memory_gib=null)" if total else None


def estimate_memory(cfg: TrainConfig, family: ModelFamily, **changes) -> dict:
    """omni/memory.py's estimate of the run's peak per device (its transformer built on the
    meta device, its own frames, resolution, micro-batch, workers, sharding, LoRA, dtype and
    checkpointing), with `changes` to those settings."""
    model = cfg.model
    tiny = model.tiny_seed is not None
    config = family.tiny_transformer_config() if tiny else family.transformer_config(model.path)
    arch = f"model.tiny_seed={model.tiny_seed} (tiny {family.name})" if tiny else f"model.path={model.path}"
    on_cuda = runs_on_cuda(cfg.trainer)
    dtype = model.dtype.value if model.dtype != DType.auto else ("bfloat16" if on_cuda else "float32")
    sizes = count(family, config, model.lora)
    if tiny:  # the family's text encoders and VAE are the published ones; a tiny model's weigh under a megabyte
        sizes.update(text_encoder_params=0, vae_params=0)
    frames = cfg.rollout.num_frames if family.video else 1
    settings = {**run_settings(cfg, family, dtype), **changes}
    return configuration(
        family, config, sizes, arch, cfg.rollout.resolution, frames, model.max_sequence_length, **settings
    )


def resolve_fsdp_version(cfg: TrainConfig, family: ModelFamily) -> None:
    """`model.fsdp.version=null`: one worker shards nothing (0); several workers replicate a
    LoRA run's base when it fits each device (0: no gathers in the rollout or the update, one
    all-reduce of the LoRA's gradients per optimizer step), else shard it with FSDP2; full
    fine-tuning shards (FSDP2: its optimizer state is the whole model's)."""
    fsdp = cfg.model.fsdp
    if fsdp.version is not None:
        return
    if cfg.trainer.n_workers == 1:
        fsdp.version = 0
        return
    if cfg.model.lora is None:
        fsdp.version = 2
        return
    budget, _ = memory_budget(cfg.trainer, runs_on_cuda(cfg.trainer))
    fits = budget is None or estimate_memory(cfg, family, fsdp=0)["gib_per_gpu"]["total"] <= budget
    fsdp.version = 0 if fits else 2


def check_memory(cfg: TrainConfig, family: ModelFamily) -> None:
    """The run's estimated peak per device (`estimate_memory`) fits the device
    (`memory_budget`). Full fine-tuning is not estimated yet, so not checked."""
    budget, budget_name = memory_budget(cfg.trainer, runs_on_cuda(cfg.trainer))
    if budget is None or cfg.model.lora is None:
        return
    row = estimate_memory(cfg, family)
    if row["gib_per_gpu"]["total"] > budget:
        checkpointed = None if cfg.model.gradient_checkpointing else estimate_memory(cfg, family, checkpointing=True)
        raise ConfigError(memory_message(family, row, checkpointed, budget_name))


def memory_message(family: ModelFamily, row: dict, checkpointed: dict | None, budget_name: str) -> str:
    """Why a run does not fit: its estimate, the keys that drive it and what would lower it."""
    gib, phase = row["gib_per_gpu"], peak_phase(row)
    frames = f"rollout.num_frames={row['num_frames']}, " if family.video else ""
    where = f"activations {gib['activations']} GiB of it" if phase == "train" else "activations not counted there"
    ways = [f"lower {'rollout.num_frames, ' if family.video else ''}rollout.resolution or trainer.micro_batch_size",
            "shard the weights over more workers (trainer.n_workers)"]  # fmt: skip
    if checkpointed is not None:
        ways.append(
            "enable gradient checkpointing (model.gradient_checkpointing=true: about "
            f"{checkpointed['gib_per_gpu']['total']} GiB)"
        )
    return (
        f"{row['arch']}: the run needs about {gib['total']} GiB per device, more than {budget_name} "
        f"({frames}rollout.resolution={row['resolution']}, trainer.micro_batch_size={row['micro_batch']}, "
        f"trainer.n_workers={row['workers']}, model.gradient_checkpointing={str(row['checkpointing']).lower()}, "
        f"model.dtype={row['dtype']}; the peak is its {phase} phase, {where}): {', or '.join(ways)}. "
        "The estimate is omni/memory.py's (python scripts/estimate_memory.py prints its parts); "
        "to run anyway, give a larger trainer.device_memory_gib"
    )
