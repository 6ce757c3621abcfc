"""What the actor-engine parity gate (omni/rollout/parity.py) costs a training step; prints one JSON object.

    python scripts/bench_parity.py [--cycles 1] [--threads 1] [hydra overrides, e.g. model=flux_tiny]

Two trainers on the same config, with an engine of its own (`rollout.share_actor=false`):
one with the gate off (`rollout.parity.every=0`), one at the config's cadence (the schema's
default unless `rollout.parity.every=N` is among the overrides). After
a warm-up step each, they take Flow-GRPO steps in turn (so other load on the machine falls on
both alike), `rollout.parity.every` steps per cycle: a cycle holds one check of the gate, as
training does at that cadence once past its first two syncs. Printed: the settings, the mean
seconds of a step without and with the gate, their ratio, and the gate's own seconds per
check (`sync/parity_seconds`) over a step's, every check counted and amortised over the
cadence (the target: under 5% of a step).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from omni.composing import compose_train
from omni.trainer import Trainer
from omni.validation import validate


def make_trainer(out_dir: Path, *overrides: str) -> Trainer:
    cfg = compose_train(
        [f"output_dir={out_dir}", "trainer.progress_bar=false", "rollout.share_actor=false", *overrides]
    )
    trainer = Trainer(validate(cfg))
    trainer.setup()
    return trainer


def timed_step(trainer: Trainer, step: int) -> tuple:
    start = time.perf_counter()
    metrics = trainer.algorithm.step(step)
    return time.perf_counter() - start, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1, help="cadences to time (each: rollout.parity.every steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out:
        off = make_trainer(Path(out) / "off", *overrides, "rollout.parity.every=0")
        on = make_trainer(Path(out) / "on", *overrides)
        every = on.cfg.rollout.parity.every
        seconds = {"off": [], "on": []}
        checks = []
        for step in range(1 + args.cycles * every):  # step 0 warms up (and is the gate's second sync)
            for name, trainer in (("off", off), ("on", on)):
                took, metrics = timed_step(trainer, step)
                if step:
                    seconds[name].append(took)
                if name == "on" and step and "sync/parity_seconds" in metrics:
                    checks.append(metrics["sync/parity_seconds"])
        cfg = on.cfg
        result = {
            "settings": {
                "model": cfg.model.family,
                "dtype": str(on.worker.dtype).removeprefix("torch."),
                "device": str(on.worker.device),
                "images_per_step": cfg.trainer.batch_size,
                "steps": cfg.rollout.num_steps,
                "resolution": cfg.rollout.resolution,
                "probe_images": cfg.rollout.parity.images,
                "every": every,
                "timed_steps": len(seconds["on"]),
                "torch_threads": torch.get_num_threads(),
            },
            "seconds_per_step_without_gate": sum(seconds["off"]) / len(seconds["off"]),
            "seconds_per_step_with_gate": sum(seconds["on"]) / len(seconds["on"]),
            "gate_checks_timed": len(checks),
            "seconds_per_check": sum(checks) / max(len(checks), 1),
        }
        result["ratio"] = result["seconds_per_step_with_gate"] / result["seconds_per_step_without_gate"]
        step_s = result["seconds_per_step_without_gate"]
        result["check_over_step"] = result["seconds_per_check"] / step_s
        result["amortised_cost_at_this_cadence"] = sum(checks) / (len(seconds["on"]) * step_s)
        for trainer in (off, on):
            trainer.cleanup()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
