"""Write scene prompts with their GenEval metadata (JSONL), for data.train / data.eval.

    python scripts/make_scene_prompts.py /tmp/scenes_train.jsonl --n 20000 --seed 7
    python recipes/train.py data=scenes data.train=/tmp/scenes_train.jsonl

Training prompts (the default) never repeat a held-out colour-attribution prompt
(omni.scenes.training_prompts). `--held-out` writes the held-out set instead, as it ships
in omni/assets/scenes_eval.jsonl; the shipped training set is `--n 1200 --seed 0`.
The same arguments always write the same file.
"""

import argparse
from pathlib import Path

from omni.scenes import held_out_prompts, to_jsonl, training_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=1200, help="prompts to write (the six categories in turn)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="write the held-out set (ignores --n and --seed)")
    args = parser.parse_args()
    items = held_out_prompts() if args.held_out else training_prompts(args.n, args.seed)
    Path(args.out).write_text(to_jsonl(items))
    print(f"{len(items)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
