"""Benchmark data-parallel workers: samples/s of the default tiny Flow-GRPO step (rollout,
reward, update and weight sync of 4 prompts x 8 images) with 1 in-process worker and with a
Ray group of 2; prints one JSON object.

    python scripts/bench_workers.py [--workers 1 2] [--steps 3] [--fsdp-version 2 0] [--threads 1]

Groups run once per `--fsdp-version` (2: FSDP2 shards; 0: a replicated base, the LoRA's
gradients averaged, what `model.fsdp.version=null` picks for a LoRA that fits). Each
setting's step is split into its phases: rollout, reward (and the part of it the rollout did
not hide), update (as the driver waits for it; `worker_seconds` inside the workers, of which
`allreduce_seconds` in the replicated base's gradient all-reduces) and sync. `--threads` is torch's intra-op threads in every worker process (the
in-process worker and each Ray worker), so 1 worker x 2 threads and 2 workers x 1 thread
use the same cores.

Each setting trains `steps` steps after a warm-up step; the median step time counts. Set-up
time (model loading, and for the group Ray's start and its workers') is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from omni.config import register_configs
from omni.config.validate import validate
from omni.trainer import Trainer

CONF = str(Path(__file__).resolve().parents[1] / "conf")
# inside the workers: the update's seconds, and those of a replicated base's gradient all-reduces
WORKER_TIMES = ("train/worker_seconds", "train/allreduce_seconds")


def make_trainer(out_dir: str, n_workers: int, fsdp_version: int) -> Trainer:
    register_configs()
    overrides = [f"output_dir={out_dir}", "trainer.progress_bar=false", f"trainer.n_workers={n_workers}"]
    overrides.append(f"model.fsdp.version={fsdp_version}")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return Trainer(validate(cfg))


def bench(n_workers: int, steps: int, fsdp_version: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = make_trainer(out_dir, n_workers, fsdp_version)
        start = time.perf_counter()
        trainer.setup()
        setup_seconds = time.perf_counter() - start
        try:
            trainer.algorithm.step(0)  # warm-up
            times, parts = [], []
            for step in range(1, steps + 1):
                start = time.perf_counter()
                metrics = trainer.algorithm.step(step)
                times.append(time.perf_counter() - start)
                parts.append({k: v for k, v in metrics.items() if k.startswith("time/") or k in WORKER_TIMES})
        finally:
            trainer.cleanup()
    seconds = statistics.median(times)
    batch = trainer.cfg.trainer.batch_size
    median_parts = {k.split("/", 1)[1]: round(statistics.median(p[k] for p in parts), 3) for k in parts[0]}
    return {
        "samples_per_step": batch,
        "seconds_per_step": round(seconds, 3),
        "samples_per_second": round(batch / seconds, 2),
        "step_parts_seconds": median_parts,
        "setup_seconds": round(setup_seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fsdp-version", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--threads", type=int, help="torch threads per worker process (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the Ray workers
        torch.set_num_threads(args.threads)
    results = {}
    for n in args.workers:
        for version in args.fsdp_version if n > 1 else [0]:
            results[f"workers_{n}" + (f"_fsdp{version}" if n > 1 else "")] = bench(n, args.steps, version)
    first = next(iter(results.values()))["samples_per_second"]
    settings = {"cpu_cores": os.cpu_count(), "threads_per_worker": args.threads or torch.get_num_threads(), "steps": args.steps}
    report = {**settings, **results, "speedup_over_first": {k: round(v["samples_per_second"] / first, 2) for k, v in results.items()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
