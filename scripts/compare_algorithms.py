"""Compare the algorithms on one task, the same steps, batch and seeds for each, trained with
the real CLI (`recipes/train.py`). Tasks (`--task`): `brightness`, the tiny random SD3 scored
by brightness; `scenes`, the pretrained micro SD3 on the compositional scenes, scored by
held-out GenEval-style accuracy (`scene_geneval/accuracy`, 300 prompts, one image each).

    python scripts/compare_algorithms.py --out comparison [--seeds 0 1] [--steps 50] [--jobs 2]
    python scripts/compare_algorithms.py --out comparison --variants flow_grpo grpo_guard
    python scripts/compare_algorithms.py --out scenes --task scenes --variants diffusion_nft flow_grpo --steps 200

Each (variant, seed) is one run in `<out>/runs/<variant>_seed<seed>`; a run already finished
there is read, not repeated. The held-out reward (ODE samples of held-out prompts and seeds,
the same before and after) is evaluated every `--eval-every` steps. Writes
`<out>/results.json` (per run: gain, paired t, held-out reward against step, images sampled
and wall time), `<out>/table.md` (mean gain and t over the seeds), and, with matplotlib,
`<out>/curves.png`. Wall time is measured from the run's start, evaluations included, so it
is comparable between variants only when the runs had the same machine (each result names
its CPU, from the run's manifest), each to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]

# name -> overrides of recipes/train.py; each model_algorithm pair file brings the tiny model's settings
VARIANTS: Dict[str, List[str]] = {
    "flow_grpo": [],
    "grpo_guard": ["algorithm=grpo_guard"],
    "flow_dppo": ["algorithm=flow_dppo"],
    "mix_grpo": ["algorithm=mix_grpo"],
    "mix_grpo_flash": ["algorithm=mix_grpo_flash"],
    "tree_grpo": ["algorithm=tree_grpo"],
    "diffusion_nft": ["algorithm=diffusion_nft"],
    "dgpo": ["algorithm=dgpo"],
    "online_dpo": ["algorithm=online_dpo"],
    "awm": ["algorithm=awm"],
    "gardo": ["algorithm=gardo"],
    "flow_grpo sde_type=cps": ["rollout.sde_type=cps"],
    "flow_grpo initial_noise=per_group": ["rollout.initial_noise=per_group"],
    "grpo_guard sde_type=cps": ["algorithm=grpo_guard", "rollout.sde_type=cps"],
    "flow_grpo adv_norm=global": ["algorithm.adv_norm=global"],
    "flow_grpo adv_norm=none": ["algorithm.adv_norm=none"],
    "flow_grpo kl_type=velocity kl_coef=0.1": ["algorithm.kl_type=velocity", "algorithm.kl_coef=0.1"],
    "flow_grpo kl_type=velocity kl_coef=0.01": ["algorithm.kl_type=velocity", "algorithm.kl_coef=0.01"],
    "flow_grpo kl_type=velocity kl_coef=0.001": ["algorithm.kl_type=velocity", "algorithm.kl_coef=0.001"],
    "flow_grpo ema_decay=0.9": ["trainer.ema_decay=0.9"],
    # every transformer weight trains: a tenth of the LoRA's step size
    "full_finetuning lr=1e-3": ["model.lora=null", "trainer.lr=1e-3"],
    "flow_grpo cfg=4.5": ["rollout.guidance_scale=4.5"],
    "flow_grpo cfg=4.5 cfg_gradient=conditional": ["rollout.guidance_scale=4.5", "algorithm.cfg_gradient=conditional"],
}
# task -> (overrides of every run, the held-out score compared: a key of eval.json's `scores`)
TASKS: Dict[str, tuple] = {
    "brightness": ([], "reward"),
    "scenes": (["model=micro", "data=scenes", "reward=scene_geneval", "eval=scenes"], "scene_geneval/accuracy"),
}
# a console line, after the log prefix Hydra's job logging adds (`[time][omni.loggers][INFO] - `)
STEP_LINE = re.compile(r"(?:^|\] - )step (\d+): (.*)$")


def slug(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", variant).strip("_")


def paired_gain(summary: dict, score: str = "reward") -> Dict[str, float]:
    """The mean held-out gain of `score` (same prompts and seeds before and after) and its
    paired t; images whose score was not finite either time are left out."""
    pairs = [(b, a) for b, a in zip(summary["scores"][score]["before"], summary["scores"][score]["after"])]
    pairs = [(b, a) for b, a in pairs if b is not None and a is not None]
    gain = torch.tensor([a - b for b, a in pairs], dtype=torch.float64)
    spread = float(gain.std()) if len(gain) > 1 else 0.0
    t = float(gain.mean()) / (spread / len(gain) ** 0.5) if spread > 0 else 0.0
    return {"gain": float(gain.mean()), "t": t, "n": len(gain)}


def start_run(variant: str, seed: int, args) -> dict:
    run_dir = args.out / "runs" / f"{slug(variant)}_seed{seed}"
    command = [
        sys.executable,
        "recipes/train.py",
        f"hydra.run.dir={run_dir}",
        f"seed={seed}",
        f"trainer.steps={args.steps}",
        f"eval.every={args.eval_every}",
        f"logger.console_every={args.eval_every}",
        "trainer.progress_bar=false",
        *TASKS[args.task][0],
        *VARIANTS[variant],
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return {
        "variant": variant,
        "seed": seed,
        "dir": run_dir,
        "process": process,
        "log": log,
        "start": time.time(),
        "curve": [],
        "score": TASKS[args.task][1],
    }


def evaluation_in(line: str, score: str) -> Optional[tuple]:
    """(step, held-out `score`) when the console line reports an evaluation, else None."""
    match = STEP_LINE.search(line.strip())
    value = re.search(rf"eval/{re.escape(score)}=([-0-9.e]+)(?:\s|$)", line) if match else None
    return (int(match.group(1)), float(value.group(1))) if value else None


def follow(run: dict) -> None:
    """Read the run's output to its end, noting the wall time of each held-out evaluation."""
    for line in run["process"].stdout:
        run["log"].write(line)
        point = evaluation_in(line, run["score"])
        if point:
            run["curve"].append({"step": point[0], "reward": point[1], "wall_s": time.time() - run["start"]})
    run["process"].wait()
    run["log"].close()


def result_of(run: dict, batch_size: int) -> dict:
    run_dir = run["dir"]
    if run["process"].returncode != 0:
        raise RuntimeError(f"{run['variant']} seed {run['seed']} failed; see {run_dir}.log")
    for point in run["curve"]:
        point["images"] = point["step"] * batch_size
    result = {
        "variant": run["variant"],
        "seed": run["seed"],
        "curve": run["curve"],
        "wall_s": time.time() - run["start"],
        # wall times compare only between runs on the same CPU
        "machine": json.loads((run_dir / "results" / "manifest.json").read_text())["machine"],
    }
    result.update(paired_gain(json.loads((run_dir / "eval.json").read_text()), run["score"]))
    (run_dir / "comparison.json").write_text(json.dumps(result))
    return result


def run_one(variant: str, seed: int, args) -> dict:
    done = args.out / "runs" / f"{slug(variant)}_seed{seed}" / "comparison.json"
    if done.exists():  # finished before: read, not repeated
        return json.loads(done.read_text())
    done.parent.parent.mkdir(parents=True, exist_ok=True)
    run = start_run(variant, seed, args)
    follow(run)
    result = result_of(run, args.batch_size)
    print(f"{variant:<30} seed {seed}: gain {result['gain']:+.5f}  t {result['t']:6.2f}", flush=True)
    return result


def run_all(args) -> List[dict]:
    """Every (variant, seed), `--jobs` at a time (a thread follows each run's output)."""
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(lambda job: run_one(*job, args), [(v, s) for v in args.variants for s in args.seeds]))


def time_to_reach(curve: List[dict], rise: float) -> Optional[float]:
    """Wall seconds until the held-out score first stood `rise` above its value at the start;
    None when it never did."""
    if not curve:
        return None
    start = curve[0]["reward"]
    return next((point["wall_s"] for point in curve if point["reward"] - start >= rise), None)


def cpus(rows: List[dict]) -> str:
    """The CPUs the rows ran on (results from before the manifest named it: "not recorded")."""
    names = {(r.get("machine") or {}).get("cpu") or "not recorded" for r in rows}
    return ", ".join(sorted(names))


def table(results: List[dict], variants: List[str], rise: float) -> str:
    lines = [
        "| variant | seeds | held-out gain (mean) | paired t per seed | wall s (mean) "
        f"| s to +{rise:g} per seed | CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        rows = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["seed"])
        if rows:
            gains = sum(r["gain"] for r in rows) / len(rows)
            ts = ", ".join(f"{r['t']:.1f}" for r in rows)
            wall = sum(r["wall_s"] for r in rows) / len(rows)
            reached = [time_to_reach(r["curve"], rise) for r in rows]
            reach = ", ".join("not reached" if s is None else f"{s:.0f}" for s in reached)
            lines.append(f"| {variant} | {len(rows)} | {gains:+.5f} | {ts} | {wall:.0f} | {reach} | {cpus(rows)} |")
    return "\n".join(lines) + "\n"


def plot(results: List[dict], variants: List[str], path: Path, score: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[compare]')")
        return False
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in variants:
        rows = [r for r in results if r["variant"] == variant and r["curve"]]
        if not rows:
            continue
        n = min(len(r["curve"]) for r in rows)
        mean = {
            key: [sum(r["curve"][i][key] for r in rows) / len(rows) for i in range(n)]
            for key in ("wall_s", "images", "reward")
        }
        for axis, key in zip(axes, ("wall_s", "images")):
            axis.plot(mean[key], mean["reward"], marker="o", label=variant)
    for axis, label in zip(axes, ("wall time (s)", "images sampled")):
        axis.set_xlabel(label)
        axis.set_ylabel(f"held-out {score} (mean over seeds)")
    axes[1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="images per step (trainer.batch_size of the runs)")
    parser.add_argument("--task", choices=list(TASKS), default="brightness")
    parser.add_argument("--reach", type=float, default=0.1, help="the rise whose time the table gives")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per run")
    parser.add_argument("overrides", nargs="*", help="more overrides for every run")
    args = parser.parse_args()
    args.overrides = [*args.overrides, f"trainer.batch_size={args.batch_size}"]
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_all(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, args.variants, args.reach)
    (args.out / "table.md").write_text(text)
    plotted = plot(results, args.variants, args.out / "curves.png", TASKS[args.task][1])
    print(
        text
        + f"written: {args.out / 'results.json'}, {args.out / 'table.md'}"
        + (f", {args.out / 'curves.png'}" if plotted else "")
    )


if __name__ == "__main__":
    main()
