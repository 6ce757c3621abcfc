"""How often reward=scene_geneval scores the renderer's own scenes right, clean and spoilt
(omni.scenes.jitter: blur up to `--blur` px, channel gain and offset, noise), per category,
and how long it takes an image.

    python scripts/bench_scene_reward.py --n 1200 --size 64
"""

import argparse
import time
from collections import defaultdict

import torch

from omni import scenes, seeding
from omni.data.prompts import Prompt
from omni.rewards.scene_geneval import SceneGeneval, SceneGenevalOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=600, help="scenes (the six categories in turn)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blur", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=0.03)
    parser.add_argument("--color", type=float, default=0.08)
    args = parser.parse_args()
    torch.set_num_threads(1)
    items = scenes.prompt_set(args.n, args.seed)
    prompts = [Prompt(item["prompt"], {k: v for k, v in item.items() if k != "prompt"}) for item in items]
    clean = torch.stack(
        [
            scenes.render(item, args.size, seeding.derive_seed(args.seed, i, seeding.SCENE_IMAGES))
            for i, item in enumerate(items)
        ]
    )
    spoilt = scenes.jitter(clean, args.seed, noise=args.noise, blur=args.blur, color=args.color)
    reward = SceneGeneval("scene_geneval", SceneGenevalOptions())
    for name, images in (("clean", clean), ("spoilt", spoilt)):
        start = time.perf_counter()
        accuracy = reward.score_details(images, prompts)[1]["accuracy"]
        per_image_ms = (time.perf_counter() - start) / len(prompts) * 1000
        by_tag = defaultdict(list)
        for prompt, correct in zip(prompts, accuracy.tolist()):
            by_tag[prompt.metadata["tag"]].append(correct)
        table = " ".join(f"{tag} {sum(v) / len(v):.3f}" for tag, v in by_tag.items())
        print(f"{name}: {float(accuracy.mean()):.4f} of {len(prompts)} ({table}); {per_image_ms:.1f} ms an image")


if __name__ == "__main__":
    main()
