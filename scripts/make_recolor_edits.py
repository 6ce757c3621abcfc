"""Write recolour edit sets (JSONL with source and target PNGs), for data.train / data.eval.

    python scripts/make_recolor_edits.py                     # the shipped sets, into omni/assets
    python scripts/make_recolor_edits.py /tmp/edits --name train --n 2000 --seed 7
    python recipes/train.py experiment=recolor data.train=/tmp/edits/train.jsonl
    python scripts/make_recolor_edits.py /tmp/edits --name pairs --n 200 --pairs   # for offline DPO
    python recipes/train.py model=flux_kontext_tiny algorithm=dpo data=pairs data.pairs=/tmp/edits/pairs.jsonl \
        data.eval=omni:recolor_eval reward=edit

The same arguments always write the same files (omni.recolor).
"""

import argparse
from pathlib import Path

from omni.recolor import SHIPPED, write_recolor_set

ASSETS = Path(__file__).resolve().parents[1] / "omni" / "assets"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ASSETS), help="folder for the JSONL and its images")
    parser.add_argument("--name", help="the set's name (its JSONL file); none: the shipped sets")
    parser.add_argument("--n", type=int, default=1000, help="edits to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", action="store_true", help="preference pairs: the edit done over the source")
    args = parser.parse_args()
    if args.pairs and not args.name:
        parser.error("--pairs writes a set of your own: name it with --name")
    sets = {args.name: (args.n, args.seed)} if args.name else SHIPPED
    for name, (n, seed) in sets.items():
        print(f"{n} edits -> {write_recolor_set(Path(args.out), name, n, seed, pairs=args.pairs)}")


if __name__ == "__main__":
    main()
