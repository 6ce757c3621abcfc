"""Will it fit? Per-GPU memory of a training run, estimated before launch.

Builds the REAL transformer on the meta device from its published config (shipped in
omni/models/configs/, or a checkpoint's own transformer/config.json), counts its weights,
the LoRA the run's config puts on it and the optimizer state, and estimates activations:

    python scripts/estimate_memory.py                      # SD3.5-Medium/Large, 512/1024 px, +-checkpointing
    python scripts/estimate_memory.py --arch sd3.5-large --resolution 1024 --micro-batch 2 \
        --gradient-checkpointing experiment=sd3_flow_grpo model.path=/ckpt/sd3.5-large
    python scripts/estimate_memory.py model=flux trainer.n_workers=8   # FLUX.1-dev/-schnell on 8 GPUs
    python scripts/estimate_memory.py experiment=flux_flow_grpo --resolution 512  # a preset chooses the model
    python scripts/estimate_memory.py model=wan --arch wan2.1-t2v-14b rollout.num_frames=33 --resolution 240x416 \
        trainer.n_workers=8 --gradient-checkpointing --gpu-memory 80   # a video model: its frames, HxW

Trailing arguments are the run's Hydra overrides (model family, LoRA rank and targets, dtype,
workers, FSDP version, text length, guidance). Prints JSON, one object per configuration, in GiB.
The family (`model=...`, default sd3) names its published architectures, its text encoders'
and VAE's sizes, its token count per image and whether guidance doubles the batch. A video
model's tokens count its clips' frames (`rollout.num_frames`, else the model's), and its
`--resolution` may be HEIGHTxWIDTH. With `--gpu-memory GIB`, an estimate above it is an error
that names the frames and resolution (nothing else checks this before a run).

What is counted, per GPU: the actor's weights (sharded over the workers by FSDP, plus the
two blocks it gathers at a time), the LoRA's fp32 masters, gradients and AdamW state
(sharded too), the transformer gathered whole for the rollout (or the engine's own copy
with rollout.share_actor=false), the text encoders (on the device only while encoding with
rollout.offload_text_encoders) and the VAE; activations of one micro-batch's forward and
backward (doubled by true CFG), as 34 bytes
per token per hidden unit per block without checkpointing (Korthikanti et al. 2022's count
for a block with memory-efficient attention) or the block inputs plus one block's with it.
It is an estimate: allocator fragmentation and temporary buffers come on top (leave ~10%).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

import torch

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def arch_config(family, name_or_path: str) -> dict:
    if name_or_path in family.published_configs:
        return json.loads((resources.files("omni") / "models" / "configs" / family.published_configs[name_or_path]).read_text())
    return json.loads((Path(name_or_path).expanduser() / "transformer" / "config.json").read_text())


def count(family, config: dict, lora) -> dict:
    """Parameters of the transformer, of its largest block, and of the LoRA `lora` puts on it."""
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
        "blocks": len(blocks),
        "text_encoder_params": family.text_encoder_params,
        "vae_params": family.vae_params,
    }


def estimate(
    sizes: dict, tokens: int, micro_batch: int, workers: int, fsdp: int, dtype: str, passes: int, checkpointing: bool,
    shared: bool = True, offload: bool = True,
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
    return {**gib, **{f"{k}_phase": round(v / GIB, 2) for k, v in phases.items()}, "total": round(max(phases.values()) / GIB, 2)}


def parse_size(text: str):
    """'512' -> 512; '240x416' -> (240, 416) (height x width)."""
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resolution {text}: expected pixels (512) or HEIGHTxWIDTH (240x416)") from None
    if len(parts) not in (1, 2) or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--resolution {text}: expected pixels (512) or HEIGHTxWIDTH (240x416)")
    return parts[0] if len(parts) == 1 else tuple(parts)


def check_fits(results: list, gpu_memory: float) -> None:
    """Refuse an architecture and resolution whose every estimate (with and without gradient
    checkpointing, as asked) exceeds `gpu_memory` GiB per GPU, naming its frames and size."""
    best = {}
    for row in results:
        key = (row["arch"], str(row["resolution"]))
        if key not in best or row["gib_per_gpu"]["total"] < best[key]["gib_per_gpu"]["total"]:
            best[key] = row
    for row in best.values():
        if row["gib_per_gpu"]["total"] > gpu_memory:
            size = "x".join(map(str, row["resolution"])) if isinstance(row["resolution"], tuple) else row["resolution"]
            frames = f"rollout.num_frames={row['num_frames']} at " if row["num_frames"] > 1 else ""
            raise SystemExit(
                f"{row['arch']}: {frames}resolution {size} needs about {row['gib_per_gpu']['total']} GiB per GPU "
                f"(micro-batch {row['micro_batch']}, {row['workers']} workers, gradient checkpointing {row['checkpointing']}), "
                f"more than --gpu-memory {gpu_memory}: fewer frames, a smaller resolution or micro-batch, or more workers"
            )


def run_config(overrides):
    from hydra import compose, initialize_config_dir

    from omni.config import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/tmp/estimate", *overrides])
    return cfg


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help="a published architecture of the family or a checkpoint directory (default: model.path, else all)")
    parser.add_argument("--resolution", type=parse_size, action="append", help="pixels or HEIGHTxWIDTH (video models); default: 512 and 1024")
    parser.add_argument("--micro-batch", type=int, help="default: trainer.micro_batch_size")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="only with (default: both)")
    parser.add_argument("--gpu-memory", type=float, help="GiB per GPU: an estimate above it is an error")
    args, overrides = parser.parse_known_args(argv)
    # the model a preset or `model=` chooses, else SD3 (a real checkpoint's settings, not the tiny one's)
    chosen = any(o.startswith(("model=", "experiment=")) for o in overrides)
    cfg = run_config([*([] if chosen else ["model=sd3"]), "model.path=/unused", "trainer=gpu", *overrides])
    from omegaconf import OmegaConf

    from omni.config.rollout import Engine, shares_actor
    from omni.models import get_family

    cfg.rollout.engine = Engine(cfg.rollout.engine)
    family = get_family(cfg.model.family)
    if cfg.model.lora is None:
        raise SystemExit("model.lora=null: this estimate models a LoRA run; full fine-tuning is not estimated yet")
    lora = OmegaConf.to_object(cfg.model.lora)
    lora.target_modules = lora.target_modules or list(family.lora_targets)
    on_disk = cfg.model.path and Path(cfg.model.path).is_dir()
    archs = [args.arch] if args.arch else ([cfg.model.path] if on_disk else list(family.published_configs))
    dtype = "bfloat16" if cfg.model.dtype == "auto" else str(cfg.model.dtype.value)
    guidance = cfg.rollout.guidance_scale if cfg.rollout.guidance_scale is not None else cfg.model.guidance_scale
    micro_batch = args.micro_batch or cfg.trainer.micro_batch_size
    frames = (cfg.rollout.num_frames or cfg.model.num_frames) if family.video else 1
    clip = {"num_frames": frames} if family.video else {}
    if not family.video and any(isinstance(r, tuple) for r in args.resolution or ()):
        raise SystemExit(f"--resolution HEIGHTxWIDTH: model.family={family.name} samples square images; give one number")
    results = []
    for arch in archs:
        config = arch_config(family, arch)
        sizes = count(family, config, lora)
        for resolution in args.resolution or [512, 1024]:
            for checkpointing in [True] if args.gradient_checkpointing else [False, True]:
                tokens = family.sequence_length(config, resolution, cfg.model.max_sequence_length, **clip)
                settings = dict(micro_batch=micro_batch, workers=cfg.trainer.n_workers, fsdp=cfg.model.fsdp.version,
                                dtype=dtype, passes=family.forward_passes(guidance), checkpointing=checkpointing,
                                shared=shares_actor(cfg), offload=cfg.rollout.offload_text_encoders)  # fmt: skip
                results.append({"arch": arch, "params": sizes["params"], "lora_params": sizes["lora_params"],
                                "resolution": resolution, "num_frames": frames, "tokens": tokens, **settings,
                                "gib_per_gpu": estimate(sizes, tokens, **settings)})  # fmt: skip
    json.dump(results, sys.stdout, indent=1)
    print()
    if args.gpu_memory is not None:
        check_fits(results, args.gpu_memory)


if __name__ == "__main__":
    main()
