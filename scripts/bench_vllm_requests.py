"""Benchmark the rollout engine's requests: one vLLM-Omni request per prompt group
(`rollout.options.requests=per_group`, the default) against one per image (`per_image`), on the
real engine, same work. Prints one JSON object with its settings.

    OMNI_VLLM_CPU=1 python scripts/bench_vllm_requests.py --python /tmp/omni-vllm-cpu/bin/python \
        --model flux_kontext_tiny --backend native [--prompts 2 --group-size 4 --rounds 5]

Both engines serve the same tiny checkpoint with its own weights (fp32, on the CPU when no GPU
is there) and sample the same prompts and seeds with the SDE (`--steps` steps, `--resolution`
pixels, no guidance): `--prompts` prompt groups of `--group-size` images a step, at most
`--prompts * --group-size` images a forward on both sides. The engines are started side by
side and take turns, one step each after a warm-up step, so a machine's changing load falls
on both alike; the median turn counts. An edit model samples the shipped recolour edits (its
sources 64 pixels square), a text-to-image one the shipped colour prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omni.data.prompt_sets import load_prompt_set
from omni.models import get_family
from omni.rollout.base import SamplingOptions
from omni.rollout.vllm_engine import VllmEngine
from omni.rollout.vllm_options import RequestsMode, VllmOptions
from omni.rollout.vllm_protocol import prompt_groups

MODES = (RequestsMode.per_group, RequestsMode.per_image)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the engine env's python (scripts/install_vllm_cpu.sh)")
    parser.add_argument("--model", default="flux_kontext_tiny", help="a tiny model config: sd3_tiny, flux_tiny, ...")
    parser.add_argument("--backend", default="native", choices=("vllm", "native"))
    parser.add_argument("--prompts", type=int, default=2, help="prompt groups a step")
    parser.add_argument("--group-size", type=int, default=4, help="images a prompt group")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed turns of each engine")
    parser.add_argument("--cache-dir", default=None, help="where the tiny checkpoint is built (default: a temp dir)")
    return parser.parse_args(argv)


def step_inputs(family, args):
    """The step's prompts (each repeated for its group) and seeds."""
    spec = "omni:recolor_train" if family.edit else "omni:colors_train"
    groups = load_prompt_set(spec)[: args.prompts]
    prompts = [prompt for prompt in groups for _ in range(args.group_size)]
    return prompts, list(range(1, len(prompts) + 1))


def main(argv=None) -> None:
    args = parse_args(argv)
    model = args.model.removesuffix("_tiny")
    family = get_family(model)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-requests-"))
    model_dir = family.tiny_path(args.cache_dir or work / "cache", 0)
    prompts, seeds = step_inputs(family, args)
    options = SamplingOptions(
        num_steps=args.steps, resolution=args.resolution, guidance_scale=0.0 if model == "sd3" else 1.0,
        noise_level=0.7, max_sequence_length=16, sde_steps=(0, args.steps),
    )  # fmt: skip
    images = len(prompts)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engines = {}
    try:
        for mode in MODES:
            opts = VllmOptions(python=args.python, backend=args.backend, requests=mode, startup_timeout=900)
            engines[mode] = VllmEngine.start(
                family,
                opts,
                model_dir,
                device,
                torch.float32,
                images,
                True,
                work / mode.value,
                group_size=args.group_size,
            )
        seconds = {mode: [] for mode in MODES}
        batches = {}
        for turn in range(args.rounds + 1):  # turn 0 warms up
            for mode, engine in engines.items():
                start = time.perf_counter()
                batches[mode] = engine.generate(prompts, seeds, options)
                if turn:
                    seconds[mode].append(time.perf_counter() - start)
        same = float((batches[MODES[0]].latents - batches[MODES[1]].latents).abs().max())
    finally:
        for engine in engines.values():
            engine.shutdown()
    per_request = {mode: (args.group_size if mode == RequestsMode.per_group else 1) for mode in MODES}
    result = {
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("python", "cache_dir")},
            "images_per_step": images,
            "dtype": "float32",
            "device": str(device),
        },
        "largest_latent_difference_between_modes": same,
    }
    for mode in MODES:
        median = statistics.median(seconds[mode])
        result[mode.value] = {
            "requests_per_step": len(prompt_groups(prompts, seeds, per_request[mode])),
            "seconds_per_step": [round(s, 3) for s in seconds[mode]],
            "median_seconds": round(median, 3),
            "images_per_s": round(images / median, 2),
        }
    result["speedup"] = round(result["per_image"]["median_seconds"] / result["per_group"]["median_seconds"], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
