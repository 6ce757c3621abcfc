"""Write a tiny random Stable Diffusion 3 checkpoint (diffusers layout) to a directory.

    python scripts/build_tiny_sd3.py /tmp/sd3-tiny --seed 0
    python recipes/train.py model=sd3 model.path=/tmp/sd3-tiny model.resolution=64 \
        model.guidance_scale=1 model.max_sequence_length=16

The same seed always gives the same weights; no network access is needed.
"""

import argparse

from omni.models.sd3 import write_tiny_sd3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_sd3(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
