"""Write a synthetic preference set: the chosen image is the brighter, or (`--scenes`) the
compositional scene its prompt asks for against one that fails it (omni.scenes.corrupt).

    python scripts/make_preference_pairs.py /tmp/prefs --n-pairs 64 --resolution 64 --seed 0
    python scripts/make_preference_pairs.py /tmp/scene-pairs --scenes --n-pairs 1200
    python scripts/make_preference_pairs.py /tmp/prefs-20k --n-pairs 20000 --layout parquet
    python scripts/make_preference_pairs.py /tmp/prefs-jpeg --resolution 512 --image-format jpeg

Prompts come from omni's colors_train set (`--scenes`: scenes_train); the same seed always writes the same pairs. The
"jsonl" layout writes image files and pairs.jsonl; "parquet" writes shards with the image bytes
embedded (as Pick-a-Pic stores its images). `--resolution 512 --image-format jpeg` writes
images like Pick-a-Pic's: JPEGs of 512 px, decoded and resized to the training resolution each
time a pair is read. The printed path is what to give the DPO recipe
as data.pairs.
"""

import argparse

from omni.data.synthetic_pairs import IMAGE_FORMATS, write_scene_pairs, write_synthetic_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--n-pairs", type=int, default=64)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--image-format", choices=list(IMAGE_FORMATS), default="png")
    parser.add_argument("--shard-size", type=int, default=5000, help="rows per parquet shard")
    parser.add_argument("--scenes", action="store_true", help="scene pairs, right against wrong (jsonl only)")
    args = parser.parse_args()
    if args.scenes:
        if args.layout != "jsonl":
            parser.error("--scenes writes the jsonl layout only")
        print(write_scene_pairs(args.out_dir, args.n_pairs, args.resolution, args.seed, args.image_format))
        return
    print(
        write_synthetic_pairs(
            args.out_dir,
            args.n_pairs,
            args.resolution,
            args.seed,
            layout=args.layout,
            shard_size=args.shard_size,
            image_format=args.image_format,
        )
    )


if __name__ == "__main__":
    main()
