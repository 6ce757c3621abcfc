"""Offline DPO data at scale, measured on the tiny SD3 (CPU); prints JSON.

    python scripts/bench_data.py                         # both measurements
    python scripts/bench_data.py --baseline /path/to/an/older/checkout   # also time its in-memory path
    python scripts/bench_data.py --only speed --image-size 64 --image-format png  # images stored at the training size

1. Memory: the peak RSS of a DPO run (model, a few steps, one held-out evaluation) over
   2,000 and over 20,000 synthetic pairs (`scripts/make_preference_pairs.py`, parquet shards
   with the images embedded). Streaming keeps only row numbers per pair, so the larger set
   should use at most 1.3x the memory of the smaller (`rss_ratio`).
2. Speed: pairs/s over one epoch of `--speed-pairs` pairs (reading the data, the algorithm's
   set-up and every step; model loading excluded) with `data.latent_cache` (built beforehand,
   by `scripts/cache_latents.py`) and without, decoding in the driver or in one worker
   process (`cache_speedup`, target >= 3). With `--baseline DIR`, the same run of the code
   in DIR (e.g. `git worktree add DIR <commit>` of a commit that encoded every pair in memory at
   set-up) is timed too, and `stream_vs_baseline` compares streaming without the cache to it.
   The pairs' images are stored as Pick-a-Pic stores its own, JPEGs of 512 px (the data set
   the cache is for), so without the cache every read decodes and resizes them to the
   training resolution; `--image-size 64 --image-format png` stores them at the training
   size instead, which costs next to nothing to read (printed under "images"). Either way
   both sides read the same files and train the same steps.
Each run is a fresh process with one CPU thread (`--threads`); the speed runs are repeated
(`--repeats`, interleaved) and the fastest of each kept, as a shared machine's load comes and
goes. Figures depend on the machine and its load (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THREADS = 1
# The VAE's encoder, as a trained VAE encodes: the tiny model's decoder inversion
# (model.vae_inversion_steps) stands in for it in learning demos, not in what is timed here.
ENCODER = "model.vae_inversion_steps=0"


def child(args) -> None:
    """One measured run in this process: set-up, `--steps` steps, optionally one evaluation."""
    from omni.trainer import Trainer, model_path
    from omni.validation import validate
    from omni.workers import build_actor_rollout
    from tests.conftest import compose_config

    overrides = [
        "algorithm=dpo",
        "data=pairs",
        f"data.pairs={args.pairs}",
        "trainer.progress_bar=false",
        f"trainer.batch_size={args.batch_size}",
        f"model.cache_dir={args.model_cache}",
        *args.overrides,
    ]
    out_dir = tempfile.mkdtemp(prefix="bench-data-run-")
    cfg = validate(compose_config(overrides, out_dir))
    tick = time.perf_counter()
    trainer = Trainer(cfg)  # reads the data (the in-memory path decoded every image here)
    reading_s = time.perf_counter() - tick
    trainer.ctx.reward.setup()
    trainer.ctx.worker = build_actor_rollout(cfg, model_path(cfg.model))  # model loading: not counted
    tick = time.perf_counter() - reading_s
    trainer.algorithm.setup()
    update_s = 0.0  # of which the updates themselves (the rest: reading, decoding, encoding)
    for step in range(args.steps):
        update_s += trainer.algorithm.step(step)["time/update"]
    seconds = time.perf_counter() - tick
    if args.evaluate:
        trainer.algorithm.evaluate()
    result = {
        "seconds": seconds,
        "update_seconds": update_s,
        "pairs": args.steps * args.batch_size,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    if hasattr(trainer.algorithm, "close"):
        trainer.algorithm.close()
    shutil.rmtree(out_dir, ignore_errors=True)
    print("RESULT " + json.dumps(result))


def measure(code_root: Path, pairs, steps: int, batch_size: int, model_cache: str, *overrides, evaluate=False) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--pairs",
        str(pairs),
        "--steps",
        str(steps),
        "--batch-size",
        str(batch_size),
        "--model-cache",
        model_cache,
        *(["--evaluate"] if evaluate else []),
        "--",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": str(THREADS)}
    done = subprocess.run(command, cwd=code_root, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measured run failed ({code_root}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def make_pairs(out_dir: Path, n: int, layout: str, image_size: int = 64, image_format: str = "png") -> Path:
    command = [
        sys.executable,
        str(REPO / "scripts" / "make_preference_pairs.py"),
        str(out_dir),
        "--n-pairs",
        str(n),
        "--layout",
        layout,
        "--resolution",
        str(image_size),
        "--image-format",
        image_format,
    ]
    return Path(
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    )


def memory(work: Path, model_cache: str, sizes, steps: int) -> dict:
    runs = {}
    for n in sizes:
        pairs = make_pairs(work / f"pairs-{n}", n, "parquet")
        runs[n] = measure(REPO, pairs, steps, 8, model_cache, "data.pairs_eval_fraction=0.01", ENCODER, evaluate=True)
    small, large = (runs[n]["peak_rss_mb"] for n in sizes)
    return {
        "peak_rss_mb": {str(n): round(r["peak_rss_mb"], 1) for n, r in runs.items()},
        "rss_ratio": round(large / small, 3),
        "rss_target": 1.3,
    }


def speed(
    work: Path, model_cache: str, n: int, batch_size: int, baseline, repeats: int, image_size: int, image_format: str
) -> dict:
    pairs = make_pairs(work / f"speed-{n}", n, "jsonl", image_size, image_format)
    steps = n // batch_size  # one epoch: every pair encoded once on each path
    common = ["data.pairs_eval_fraction=0", "data.latent_cache=null", ENCODER]
    cache = work / f"speed-{n}-latents"
    tick = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "cache_latents.py"),
            "algorithm=dpo",
            "data=pairs",
            ENCODER,
            f"data.pairs={pairs}",
            f"data.latent_cache={cache}",
            f"model.cache_dir={model_cache}",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(THREADS)},
    )
    build_s = time.perf_counter() - tick
    runs = {
        "streamed": (REPO, common),
        "streamed_1_worker": (REPO, [*common, "data.num_workers=1"]),
        "latent_cache": (REPO, [*common, f"data.latent_cache={cache}"]),
    }
    if baseline:
        # the in-memory code predates model.vae_inversion_steps: it always used the VAE's encoder
        runs["baseline_in_memory"] = (Path(baseline), [o for o in common if o != ENCODER])
    best = {}
    for _ in range(repeats):  # interleaved, so a burst of load hits every configuration alike
        for name, (root, overrides) in runs.items():
            result = measure(root, pairs, steps, batch_size, model_cache, *overrides)
            rate = result["pairs"] / result["seconds"]
            if rate > best.get(name, (0.0,))[0]:
                best[name] = (rate, result["update_seconds"] / result["seconds"])
    out = {
        "pairs": n,
        "steps": steps,
        "batch_size": batch_size,
        "repeats": repeats,
        "images": f"{image_size} px {image_format}",
        "pairs_per_s": {name: round(rate, 2) for name, (rate, _) in best.items()},
        "update_share": {name: round(share, 2) for name, (_, share) in best.items()},
        "cache_speedup": round(best["latent_cache"][0] / best["streamed"][0], 2),
        "cache_speedup_target": 3.0,
        "cache_build_s": round(build_s, 1),
    }
    if baseline:
        out["stream_vs_baseline"] = round(best["streamed"][0] / best["baseline_in_memory"][0], 2)
        out["stream_1_worker_vs_baseline"] = round(best["streamed_1_worker"][0] / best["baseline_in_memory"][0], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", help=argparse.SUPPRESS)
    parser.add_argument("--evaluate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help="steps of each memory run")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--sizes", type=int, nargs=2, default=[2000, 20000], help="the two set sizes of the memory runs"
    )
    parser.add_argument("--speed-pairs", type=int, default=160)
    parser.add_argument(
        "--image-size",
        type=int,
        default=512,
        help="pixels of the speed runs' images (Pick-a-Pic's are about 512; the model trains at 64)",
    )
    parser.add_argument(
        "--image-format", choices=["png", "jpeg"], default="jpeg", help="how the speed runs' images are stored"
    )
    parser.add_argument("--baseline", help="a checkout of older code to time the same run on")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each speed configuration (the fastest is kept)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each run")
    parser.add_argument("--only", choices=["memory", "speed"])
    parser.add_argument("--model-cache", default=os.environ.get("OMNI_CACHE_DIR", "~/.cache/omni-recipes"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.child:
        return child(args)
    global THREADS
    THREADS = args.threads
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        result = {"load_average": os.getloadavg(), "cpus": os.cpu_count(), "threads": THREADS}
        if args.only != "speed":
            result["memory"] = memory(work, args.model_cache, args.sizes, args.steps)
        if args.only != "memory":
            result["speed"] = speed(
                work,
                args.model_cache,
                args.speed_pairs,
                args.batch_size,
                args.baseline,
                args.repeats,
                args.image_size,
                args.image_format,
            )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
