"""Every GPU figure of the project in one command, inside one time budget; one JSON file.

    bash scripts/gpu_suite.sh                         # writes docs/benchmarks/gpu/<date>.json
    python scripts/gpu_suite.py --budget-s 420 --out /tmp/suite.json

Parts, run one after the other as their own processes (a part that crashes is reported with
its last output and the next one runs):

- `bench_<arch>`: scripts/bench_gpu.py on SD3.5-Medium and FLUX.1-dev shapes with random weights
  (one process each; SD3.5-Medium again with its LoRA in bf16, `_lora_bf16`):
  rollout images/s against the diffusers pipeline, update transitions/s, MFU, peak memory
  per phase, the memory estimator against the measured peak (error in %), the bf16 noise
  floor of the importance ratios, LoRA collection seconds;
- `fsdp`: scripts/gpu_check_fsdp.py (FSDP1 with CPU offload, FSDP2 with mixed precision);
- `async_overlap`: scripts/bench_async.py --one-gpu (the default tiny Flow-GRPO step): the
  synchronous step on the device against `trainer.rollout_mode=async`, this process training
  while one Ray rollout worker samples the next step on the same device, with the default
  reward and a slow `http` one; its phase times also feed the bench's 8- and 64-GPU projection.
  Without a GPU it is named under `not_measured` (bench_async.py measures the overlap with CPU
  processes, outside the suite).

Each part gets what is left of `--budget-s` (less a reserve for the parts after it); a part
that would not fit is skipped and named under `skipped`. Without a CUDA device the suite
runs each part's CPU check instead (the tiny models, gloo processes) and says that no GPU
was there (`"gpu": null`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sd3.5-medium", "flux.1-dev")
# (arch, extra arguments): the recipes' fp32 LoRA masters, then SD3.5-Medium with the LoRA in
# bf16 (tells a failure of fp32 LoRA matrix products from one of the model's)
GPU_BENCHES = [
    (f"bench_{ARCHS[0]}", ARCHS[0], []),
    (f"bench_{ARCHS[1]}", ARCHS[1], []),
    (f"bench_{ARCHS[0]}_lora_bf16", ARCHS[0], ["--lora-dtype", "model", "--repeats", "1"]),
]


ASYNC_CAP_S = 150  # scripts/bench_async.py --one-gpu: two trainers' set-up, 4 steps each, two rewards


def device_info() -> dict | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(), "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}  # fmt: skip


def last_json(text: str):
    """The last line of `text` that parses as JSON, or the whole text parsed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        for line in reversed(text.strip().splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_part(argv: list, timeout: float) -> dict:
    """Run one part; its JSON, or its exit code and last output when it gave none."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:]
        return {"error": f"timed out after {timeout:.0f} s", "output_tail": str(tail)}
    result = {"seconds": round(time.monotonic() - start, 1), "returncode": done.returncode}
    parsed = last_json(done.stdout)
    if parsed is None or done.returncode not in (0,):
        result["stderr_tail"] = done.stderr[-3000:]
    result["result"] = parsed
    return result


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="all parts together")
    parser.add_argument("--out", help="default: docs/benchmarks/gpu/<date>.json")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    gpu = device_info()
    today = datetime.date.today().isoformat()
    report = {
        "date": today,
        "gpu": gpu,
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "budget_s": args.budget_s,
        "parts": {},
        "skipped": [],
        "not_measured": {},
    }
    if gpu is None:
        report["note"] = "no GPU was there: each part's CPU check ran instead (tiny models, gloo); no GPU figure"
        tiny = ["--tiny", "--device", "cpu", "--dtype", "float32", "--resolution", "64", "--repeats", "1"]
        parts = [(f"bench_{arch}", ["scripts/bench_gpu.py", "--arch", arch, *tiny]) for arch in ARCHS]
        parts.append(("fsdp", ["scripts/gpu_check_fsdp.py", "--cpu"]))
    else:
        # the FSDP check first (quick), then one process per architecture: a CUDA error in one
        # leaves the other's figures; each bench gets its share of what is left
        parts = [("fsdp", ["scripts/gpu_check_fsdp.py"])]
        parts.append(("async_overlap", ["scripts/bench_async.py", "--one-gpu", "--steps", "4"]))
        parts += [(name, ["scripts/bench_gpu.py", "--arch", arch, *extra]) for name, arch, extra in GPU_BENCHES]
    for i, (name, argv_part) in enumerate(parts):
        left = deadline - time.monotonic()
        share = left / (len(parts) - i) if name.startswith("bench") else left
        if share < 30:
            report["skipped"].append(f"{name}: {share:.0f} s left of --budget-s")
            continue
        if name.startswith("bench") and gpu is not None:
            argv_part = [*argv_part, "--time-budget-s", str(int(max(share - 60, 30)))]  # 60 s: imports, building
        # the async bench has no time budget of its own: a cap leaves the benches after it their share
        report["parts"][name] = run_part(argv_part, min(left, ASYNC_CAP_S) if name == "async_overlap" else left)
    if gpu is None:
        report["not_measured"]["async_overlap"] = (
            "no GPU: scripts/bench_async.py --one-gpu needs a CUDA device (without it, bench_async.py measures the "
            "overlap with CPU processes)"
        )
    report["elapsed_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / "gpu" / f"{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"written": str(out), "elapsed_s": report["elapsed_s"], "skipped": report["skipped"],
                      "failed": [k for k, v in report["parts"].items() if v.get("returncode") != 0]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
