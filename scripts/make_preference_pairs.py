"""Write a small synthetic preference set (pairs.jsonl + PNGs) where the chosen image is the brighter.

    python scripts/make_preference_pairs.py /tmp/prefs --n-pairs 64 --resolution 64 --seed 0

Prompts come from omni's colors_train set; the same seed always writes the same files. The
printed path is the JSONL file to give the DPO recipe as its preference data.
"""

import argparse

from omni.data.synthetic_pairs import write_synthetic_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--n-pairs", type=int, default=64)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_synthetic_pairs(args.out_dir, args.n_pairs, args.resolution, args.seed))


if __name__ == "__main__":
    main()
