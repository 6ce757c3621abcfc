"""Held-out scores of a recolour edit checkpoint (the micro FLUX.1 Kontext of
scripts/pretrain_micro_kontext.py, or any FLUX.1 Kontext directory): each edit of the shipped
held-out set (omni:recolor_eval, 32 edits) sampled `--images` times from fixed seeds with the
recipes' own sampler (omni.rollout.sampling.sample_rollout: the deterministic ODE, Euler
steps, FLUX's distilled guidance), and the means of edit_target (closeness to the target on
the recoloured shape) and edit_consistency (closeness to the source elsewhere).

    python scripts/eval_micro_kontext.py omni/assets/micro_kontext --steps 20 --guidance 2.5
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omni.data.prompt_sets import load_prompt_set
from omni.models import get_family
from omni.rewards.edit_consistency import EditConsistency, EditConsistencyOptions
from omni.rewards.edit_target import EditTarget, EditTargetOptions
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout


@torch.no_grad()
def evaluate(path: str, steps: int = 20, guidance: float = 2.5, images: int = 1, resolution: int = 64) -> dict:
    """Mean held-out edit_target and edit_consistency, and the per-image scores."""
    family = get_family("flux_kontext")
    pipe = family.load_pipeline(path, torch.float32)
    edits = load_prompt_set("omni:recolor_eval", "data.eval")
    prompts = [edit for edit in edits for _ in range(images)]
    options = SamplingOptions(
        num_steps=steps,
        resolution=resolution,
        guidance_scale=guidance,
        noise_level=0.7,
        max_sequence_length=pipe.tokenizer_2.model_max_length,
        sde_steps=(0, 0),
    )
    batch = sample_rollout(
        family, pipe, prompts, list(range(len(prompts))), options, 16, torch.device("cpu"), torch.float32
    )
    target = EditTarget("edit_target", EditTargetOptions()).score(batch.images, prompts)
    consistency = EditConsistency("edit_consistency", EditConsistencyOptions()).score(batch.images, prompts)
    return {
        "edit_target": float(target.mean()),
        "edit_consistency": float(consistency.mean()),
        "scores": {"edit_target": target.tolist(), "edit_consistency": consistency.tolist()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="checkpoint directories")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=2.5)
    parser.add_argument("--images", type=int, default=1, help="samples per held-out edit")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for path in args.paths:
        start = time.perf_counter()
        result = evaluate(path, args.steps, args.guidance, args.images)
        summary = {k: round(result[k], 4) for k in ("edit_target", "edit_consistency")}
        print(json.dumps({"path": path, **summary, "s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
