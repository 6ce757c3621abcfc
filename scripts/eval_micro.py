"""Held-out accuracy of a scene checkpoint (the micro SD3 of scripts/pretrain_micro.py), as
GenEval reports it: each of the 300 held-out prompts (omni/assets/scenes_eval.jsonl) sampled
once from a fixed seed (its index), scored 1 or 0 by reward=scene_geneval, and the accuracy
per category and overall.

    python scripts/eval_micro.py omni/assets/micro --steps 20 --guidance 5.0

Sampling is diffusers' StableDiffusion3Pipeline: Euler steps of the flow-matching ODE with
classifier-free guidance, at the checkpoint's resolution (64 px).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omni import scenes
from omni.data.prompts import Prompt


@torch.no_grad()
def sample(pipe, items, steps: int, guidance: float, size: int = 64, chunk: int = 50) -> torch.Tensor:
    """One image (3, size, size) in [0, 1] per item, item i from seed i."""
    images = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        generators = [torch.Generator().manual_seed(start + k) for k in range(len(part))]
        out = pipe(
            prompt=[item["prompt"] for item in part],
            num_inference_steps=steps,
            guidance_scale=guidance,
            height=size,
            width=size,
            generator=generators,
            output_type="pt",
            max_sequence_length=16,
        )
        images.append(out.images.float())
    return torch.cat(images)


def accuracy_table(images: torch.Tensor, items) -> dict:
    """Per-category and overall accuracy of the images under scene_geneval."""
    from omni.rewards.scene_geneval import SceneGeneval, SceneGenevalOptions

    prompts = [Prompt(item["prompt"], item) for item in items]
    correct = SceneGeneval("scene_geneval", SceneGenevalOptions()).score_details(images, prompts)[1]["accuracy"]
    table = {
        tag: float(correct[[i for i, item in enumerate(items) if item["tag"] == tag]].mean()) for tag in scenes.TAGS
    }
    table["overall"] = float(correct.mean())
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--shift", type=float, help="the scheduler's shift (default: the checkpoint's)")
    parser.add_argument("--every", type=int, default=1, help="score every n-th held-out prompt only")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    from diffusers import StableDiffusion3Pipeline

    torch.set_num_threads(args.threads)
    pipe = StableDiffusion3Pipeline.from_pretrained(args.checkpoint, local_files_only=True)
    if args.shift is not None:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=args.shift)
    pipe.set_progress_bar_config(disable=True)
    items = scenes.held_out_prompts()[:: args.every]
    start = time.perf_counter()
    table = accuracy_table(sample(pipe, items, args.steps, args.guidance), items)
    table["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps({k: round(v, 3) for k, v in table.items()}))


if __name__ == "__main__":
    main()
