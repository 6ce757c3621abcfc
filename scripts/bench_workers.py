"""Benchmark data-parallel workers: samples/s of the default tiny Flow-GRPO step (rollout,
reward, update and weight sync of 4 prompts x 8 images) with 1 in-process worker and with a
Ray group of 2; prints one JSON object.

    python scripts/bench_workers.py [--workers 1 2] [--steps 3]

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

from hydra import compose, initialize_config_dir

from omni.config import register_configs
from omni.config.validate import validate
from omni.trainer import Trainer

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def make_trainer(out_dir: str, n_workers: int) -> Trainer:
    register_configs()
    overrides = [f"output_dir={out_dir}", "trainer.progress_bar=false", f"trainer.n_workers={n_workers}"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return Trainer(validate(cfg))


def bench(n_workers: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = make_trainer(out_dir, n_workers)
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
                parts.append({k: v for k, v in metrics.items() if k.startswith("time/")})
        finally:
            trainer.cleanup()
    seconds = statistics.median(times)
    batch = trainer.cfg.trainer.batch_size
    median_parts = {k.split("/")[1]: round(statistics.median(p[k] for p in parts), 3) for k in parts[0]}
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
    args = parser.parse_args()
    results = {f"workers_{n}": bench(n, args.steps) for n in args.workers}
    rates = [results[f"workers_{n}"]["samples_per_second"] for n in args.workers]
    report = {"cpu_cores": os.cpu_count(), **results, "speedup_over_first": [round(r / rates[0], 2) for r in rates]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
