"""Benchmark trainer.rollout_mode=async against the synchronous Ray group of the same worker
count: images/s of the default tiny Flow-GRPO step (4 prompts x 8 images), with the default
reward and with a slow `http` reward (our reward server on 127.0.0.1, a fixed latency added to
every scoring); then a cost model that projects images/s on 8 and 64 GPUs. Prints one JSON object.

    python scripts/bench_async.py [--workers 2] [--steps 6] [--latency-s 0.2] [--staleness 1]
    python scripts/bench_async.py --one-gpu          # both sides on one CUDA device

Same work on both sides: `--workers` processes of one torch thread each. Synchronous: a Ray
group of that many actor-rollout workers (a replicated base, model.fsdp.version=0), each
sampling, scoring and updating its share. Asynchronous: one training worker in this process and
`workers - 1` Ray rollout workers, which sample step k + 1 while step k updates.

With `--one-gpu` both sides share one CUDA device: synchronous, one worker in this process
samples, scores and updates; asynchronous, this process trains on the device while one Ray
rollout worker samples on the same device (`trainer.n_gpus_per_node=1`: the rollout worker
holds Ray's one GPU, and the training worker, which is not a Ray actor, uses it beside it). So
the figure is the overlap one device gives, not a gain from more hardware.

The two trainers are set up side by side and take turns, one step each after a warm-up step,
so a machine's changing load falls on both alike. An asynchronous turn also waits for the
rollouts it submitted (sampled ahead for the next step) to finish, so no work of one trainer
runs in the other's turn and every image sampled is counted where it was made. The median
turn counts.

The cost model (`projection`) is labelled as one: from the measured per-image seconds of each
phase on one worker (rollout, reward, update) and the per-step sync, it assumes perfect data
parallelism inside a group (no all-reduce or straggler cost), a reward that scales with the
rollout workers, and for async the best split of the GPUs between rollout and training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from omni.composing import compose_train
from omni.distributed import free_port
from omni.trainer import Trainer
from omni.validation import validate

REPO = Path(__file__).resolve().parents[1]
PHASES = ("time/rollout", "time/reward", "time/update", "time/sync")


def side_overrides(workers: int, mode: str, staleness: int, one_gpu: bool = False) -> list:
    """The overrides of one side: `workers` processes (one GPU: one process on the device for
    sync, the trainer and one rollout worker sharing it for async)."""
    if one_gpu:
        sync, rollout_workers = ["trainer.n_gpus_per_node=1", "trainer.device=cuda"], 1
    else:
        sync, rollout_workers = [f"trainer.n_workers={workers}"], workers - 1
    if mode == "sync":
        return sync
    return [
        *(sync if one_gpu else []),
        "trainer.rollout_mode=async",
        f"trainer.max_staleness={staleness}",
        f"trainer.rollout_workers={rollout_workers}",
    ]


def make_trainer(out_dir: Path, workers: int, mode: str, staleness: int, reward: list, one_gpu: bool) -> Trainer:
    overrides = [f"output_dir={out_dir}", "trainer.progress_bar=false", "model.fsdp.version=0", *reward]
    overrides += side_overrides(workers, mode, staleness, one_gpu)
    trainer = Trainer(validate(compose_train(overrides)))
    trainer.setup()
    return trainer


def turn(trainer: Trainer, step: int) -> tuple:
    """One step, and for async the rollouts it submitted: (seconds, phase seconds)."""
    start = time.perf_counter()
    metrics = trainer.run_step(step)
    if trainer.rollouts is not None:
        for _, future in list(trainer.rollouts.pending.values()):
            future.result()
    return time.perf_counter() - start, {k: metrics[k] for k in PHASES if k in metrics}


def compare(workers: int, staleness: int, steps: int, reward: list, one_gpu: bool = False) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        trainers = {}
        try:
            for mode in ("sync", "async"):
                tick = time.perf_counter()
                trainers[mode] = make_trainer(Path(out_dir) / mode, workers, mode, staleness, reward, one_gpu)
                turn(trainers[mode], 0)  # warm-up
                results[mode] = {"setup_seconds": round(time.perf_counter() - tick, 1)}
            timed = {mode: ([], []) for mode in trainers}
            for step in range(1, steps + 1):
                for mode, trainer in trainers.items():
                    seconds, phases = turn(trainer, step)
                    timed[mode][0].append(seconds)
                    timed[mode][1].append(phases)
        finally:
            for trainer in trainers.values():
                trainer.cleanup()
    batch = trainers["sync"].cfg.trainer.batch_size
    for mode, (seconds, phases) in timed.items():
        median = statistics.median(seconds)
        results[mode].update(
            seconds_per_step=round(median, 3),
            images_per_second=round(batch / median, 2),
            phase_seconds={k.split("/")[1]: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]},
        )
    results["images_per_step"] = batch
    results["async_speedup"] = round(results["sync"]["seconds_per_step"] / results["async"]["seconds_per_step"], 2)
    return results


def projection(phases: dict, batch: int, gpus: int) -> dict:
    """images/s on `gpus` workers from one worker's phase seconds of a step of `batch` images
    per worker. Sync: each worker samples, scores and updates its images, then syncs. Async:
    R workers sample and score, G - R update theirs (and sync) meanwhile; the best R."""
    rollout = (phases["rollout"] + phases["reward"]) / batch  # seconds per image
    update = (phases["update"] + phases["sync"]) / batch
    sync_rate = gpus / (rollout + update)
    best = max((min(r / rollout, (gpus - r) / update), r) for r in range(1, gpus))
    return {
        "sync_images_per_second": round(sync_rate, 1),
        "async_images_per_second": round(best[0], 1),
        "async_rollout_gpus": best[1],
    }


def reward_server(latency_s: float):
    port = free_port()
    command = [sys.executable, "-m", "omni.rewards.serve", "--port", str(port), "--latency-s", str(latency_s)]
    server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx

    for _ in range(300):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
            return server, port
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("the reward server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="processes on each side (async: 1 trains)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", type=int, default=1, help="trainer.max_staleness of the async side")
    parser.add_argument("--latency-s", type=float, default=0.2, help="the slow reward's added seconds per scoring")
    parser.add_argument("--one-gpu", action="store_true", help="both sides on one CUDA device (docstring)")
    args = parser.parse_args()
    if args.one_gpu and not torch.cuda.is_available():
        parser.error("--one-gpu needs a CUDA device; this machine shows none")
    workers = 2 if args.one_gpu else args.workers
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the Ray workers
    torch.set_num_threads(1)
    import ray

    # logical CPUs for both trainers' workers at once; they take turns, so the cores are shared
    ray.init(address="local", num_cpus=2 * workers, include_dashboard=False)
    report = {
        "settings": {
            "date": time.strftime("%Y-%m-%d"),
            "cpu_cores": os.cpu_count(),
            "threads_per_process": 1,
            "workers": workers,
            "one_gpu": args.one_gpu,
            "steps": args.steps,
            "max_staleness": args.staleness,
            "slow_reward_latency_s": args.latency_s,
        }
    }
    report["default_reward"] = compare(workers, args.staleness, args.steps, [], args.one_gpu)
    server, port = reward_server(args.latency_s)
    try:
        url = f"reward.components.http.url=http://127.0.0.1:{port}"
        report["slow_http_reward"] = compare(workers, args.staleness, args.steps, ["reward=http", url], args.one_gpu)
    finally:
        server.kill()
    ray.shutdown()
    # one worker's phases: the synchronous group's, each worker with batch / workers images
    for name in ("default_reward", "slow_http_reward"):
        phases = report[name]["sync"]["phase_seconds"]
        per_worker = report[name]["images_per_step"] // (1 if args.one_gpu else workers)
        report[name]["projection"] = {
            "note": "a projection from the measured phase times, not a measurement (assumptions: the docstring)",
            **{f"{g}_gpus": projection(phases, per_worker, g) for g in (8, 64)},
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
