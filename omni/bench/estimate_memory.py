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
that names the frames and resolution.

What is counted, and how, is omni/memory.py's (a run checks the same estimate against
`trainer.device_memory_gib` at validation).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omni.memory import DoesNotFit, arch_config, check_fits, configuration, count, run_settings


def parse_size(text: str):
    """'512' -> 512; '240x416' -> (240, 416) (height x width)."""
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--resolution {text}: expected pixels (512) or HEIGHTxWIDTH (240x416)"
        ) from None
    if len(parts) not in (1, 2) or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--resolution {text}: expected pixels (512) or HEIGHTxWIDTH (240x416)")
    return parts[0] if len(parts) == 1 else tuple(parts)


def run_config(overrides):
    from omni.composing import compose_train

    return compose_train(["output_dir=/tmp/estimate", *overrides])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        help="a published architecture of the family or a checkpoint directory (default: model.path, else all)",
    )
    parser.add_argument(
        "--resolution",
        type=parse_size,
        action="append",
        help="pixels or HEIGHTxWIDTH (video models); default: 512 and 1024",
    )
    parser.add_argument("--micro-batch", type=int, help="default: trainer.micro_batch_size")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="only with (default: both)")
    parser.add_argument("--gpu-memory", type=float, help="GiB per GPU: an estimate above it is an error")
    args, overrides = parser.parse_known_args(argv)
    # the model a preset or `model=` chooses, else SD3 (a real checkpoint's settings, not the tiny one's)
    chosen = any(o.startswith(("model=", "experiment=")) for o in overrides)
    cfg = run_config([*([] if chosen else ["model=sd3"]), "model.path=/unused", "trainer=gpu", *overrides])
    from omegaconf import OmegaConf

    from omni.models import get_family

    family = get_family(cfg.model.family)
    if cfg.model.lora is None:
        raise SystemExit("model.lora=null: this estimate models a LoRA run; full fine-tuning is not estimated yet")
    lora = OmegaConf.to_object(cfg.model.lora)
    lora.target_modules = lora.target_modules or list(family.lora_targets)
    on_disk = cfg.model.path and Path(cfg.model.path).is_dir()
    archs = [args.arch] if args.arch else ([cfg.model.path] if on_disk else list(family.published_configs))
    dtype = "bfloat16" if cfg.model.dtype == "auto" else str(cfg.model.dtype.value)
    settings = {**run_settings(cfg, family, dtype), "micro_batch": args.micro_batch or cfg.trainer.micro_batch_size}
    frames = (cfg.rollout.num_frames or cfg.model.num_frames) if family.video else 1
    if not family.video and any(isinstance(r, tuple) for r in args.resolution or ()):
        raise SystemExit(
            f"--resolution HEIGHTxWIDTH: model.family={family.name} samples square images; give one number"
        )
    results = []
    for arch in archs:
        config = arch_config(family, arch)
        sizes = count(family, config, lora)
        for resolution in args.resolution or [512, 1024]:
            for checkpointing in [True] if args.gradient_checkpointing else [False, True]:
                results.append(
                    configuration(
                        family,
                        config,
                        sizes,
                        arch,
                        resolution,
                        frames,
                        cfg.model.max_sequence_length,
                        **{**settings, "checkpointing": checkpointing},
                    )
                )
    json.dump(results, sys.stdout, indent=1)
    print()
    if args.gpu_memory is not None:
        try:
            check_fits(results, args.gpu_memory)
        except DoesNotFit as error:
            raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
