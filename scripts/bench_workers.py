"""Benchmark data-parallel workers: samples/s of the default tiny Flow-GRPO step (rollout,
reward, update and weight sync of 4 prompts x 8 images) with 1 in-process worker and with a
Ray group of 2; prints one JSON object.

    python scripts/bench_workers.py [--workers 2] [--steps 8] [--fsdp-version 0 2] [--threads 1]

Groups run once per `--fsdp-version` (2: FSDP2 shards; 0: a replicated base, the LoRA's
gradients averaged, what `model.fsdp.version=null` picks for a LoRA that fits). Each
setting's step is split into its phases: rollout, reward (and the part of it the rollout did
not hide), update (as the driver waits for it; `worker_seconds` inside the workers, of which
`allreduce_seconds` in the replicated base's gradient all-reduces) and sync. `--threads` is
torch's intra-op threads in every worker process (the in-process worker and each Ray
worker), so 1 worker x 2 threads and 2 workers x 1 thread use the same cores.

The one-worker trainer and each group in turn are set up side by side, then take turns step
by step (so a machine's changing load falls on both alike), `steps` steps each after a
warm-up step; the median step time counts and each group's speedup is over the one-worker
steps of its turns. Set-up time (model loading, and for a group Ray's start and its
workers') is reported apart.
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

from omni.composing import compose_train
from omni.trainer import Trainer
from omni.validation import validate

# inside the workers: the update's seconds, and those of a replicated base's gradient all-reduces
WORKER_TIMES = ("train/worker_seconds", "train/allreduce_seconds")


def make_trainer(out_dir: str, n_workers: int, fsdp_version: int) -> Trainer:
    overrides = [f"output_dir={out_dir}", "trainer.progress_bar=false", f"trainer.n_workers={n_workers}"]
    overrides.append(f"model.fsdp.version={fsdp_version}")
    return Trainer(validate(compose_train(overrides)))


def timed_step(trainer: Trainer, step: int) -> tuple:
    start = time.perf_counter()
    metrics = trainer.algorithm.step(step)
    return time.perf_counter() - start, {k: v for k, v in metrics.items() if k.startswith("time/") or k in WORKER_TIMES}


def summary(trainer: Trainer, times: list, parts: list, setup_seconds: float) -> dict:
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


def set_up(out_dir: str, name: str, n_workers: int, version: int) -> tuple:
    trainer = make_trainer(str(Path(out_dir) / name), n_workers, version)
    start = time.perf_counter()
    trainer.setup()
    setup_seconds = time.perf_counter() - start
    trainer.algorithm.step(0)  # warm-up
    return trainer, setup_seconds


def alternate(trainers: dict, steps: int) -> dict:
    """name -> (step seconds, step parts) of `steps` steps of each trainer, taken in turn."""
    timed = {name: ([], []) for name in trainers}
    for step in range(1, steps + 1):
        for name, trainer in trainers.items():
            seconds, parts = timed_step(trainer, step)
            timed[name][0].append(seconds)
            timed[name][1].append(parts)
    return timed


def bench(n_workers: list, versions: list, steps: int) -> dict:
    """One worker against each group: the one-worker trainer and one group (Ray reserves the
    machine's cores for it, so one group at a time) set up side by side, their steps taken in
    turn after a warm-up step of each, so a machine's changing load falls on both alike; the
    median step of each counts, and each group's speedup is over the one-worker steps taken
    in its turns."""
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        one, one_setup = set_up(out_dir, "workers_1", 1, 0)
        try:
            for n in [n for n in n_workers if n > 1]:
                for version in versions:
                    name = f"workers_{n}_fsdp{version}"
                    group, group_setup = set_up(out_dir, name, n, version)
                    try:
                        timed = alternate({"workers_1": one, name: group}, steps)
                    finally:
                        group.cleanup()
                    results[f"workers_1 (turns with {name})"] = summary(one, *timed["workers_1"], one_setup)
                    results[name] = summary(group, *timed[name], group_setup)
                    results[name]["speedup_over_one_worker"] = round(
                        statistics.median(timed["workers_1"][0]) / statistics.median(timed[name][0]), 2
                    )
        finally:
            one.cleanup()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2], help="group sizes, each against one worker")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fsdp-version", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--threads", type=int, help="torch threads per worker process (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the Ray workers
        torch.set_num_threads(args.threads)
    results = bench(args.workers, args.fsdp_version, args.steps)
    settings = {
        "cpu_cores": os.cpu_count(),
        "threads_per_worker": args.threads or torch.get_num_threads(),
        "steps": args.steps,
    }
    speedups = {k: v["speedup_over_one_worker"] for k, v in results.items() if "speedup_over_one_worker" in v}
    report = {**settings, **results, "speedup_over_one_worker": speedups}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
