"""Seconds per Flow-GRPO training step: flow_grpo's own SD3 trainer against ours, on the same work.

    python scripts/bench_flow_grpo.py --flow-grpo /path/to/flow_grpo --flow-grpo-python ENV/bin/python --rounds 3
    python scripts/bench_flow_grpo.py                  # ours only (no flow_grpo checkout given)

Both trainers run unmodified, each as its own process, on one tiny random SD3 checkpoint that
this script writes (diffusers layout, CLIP tokenizers and encoders of 77 tokens as real SD3
has, T5 padded to 128 tokens as flow_grpo pads it), and on the same work per step: 2 prompts
x 4 images, 10 SDE steps at noise level 0.7, 64 px, CFG 4.5, the JPEG-compressibility
reward, then the 80 transitions (8 samples x 10 denoising steps) trained in 2 minibatches,
one optimizer step each (clip range 1e-4, AdamW at lr 3e-4), a LoRA of rank 32
(alpha 64) on the same eight attention projections, float32, one thread on each side
(OMP_NUM_THREADS=1, so torch runs one intra-op thread), no evaluation past the one each
trainer makes before its first step, no checkpoints, no wandb. How many rows one forward
carries is each trainer's own: flow_grpo samples and trains 4 samples at a time (its sampling
batch, one prompt's group), ours samples a step's 8 images in one batch and trains a whole
minibatch (40 transitions of mixed denoising steps) per forward and backward
(`rollout.micro_batch_size`, `trainer.micro_batch_size`): the same images, transitions and
optimizer steps, in fewer, larger calls.

flow_grpo's `scripts/train_sd3.py` is run with a config file of ours (written in a temporary
directory) that loads its `config/base.py` and sets its fields; its prompts are text files
(`train.txt`, `test.txt`) in a dataset directory. It trains until killed. Ours is
`recipes/train.py` with Hydra overrides. Neither is edited. flow_grpo's environment needs
torch, diffusers, transformers, peft, accelerate, ml_collections, absl-py and wandb; its script
runs unmodified with the versions ours uses (its pins, e.g. torch 2.6, are not needed on the CPU).

How a step is timed (the same way on both sides): each trainer prints one line per step,
unbuffered (PYTHONUNBUFFERED=1) -- flow_grpo `advantages: ...` once a step's rollout is
scored, ours `step N: ...` once a step is done -- and this script stamps each line as it
reads it. The time between two consecutive lines is one full step: for flow_grpo the update
of step k and the rollout of step k+1, for ours the rollout and update of step k+1. Set-up,
model loading, the first evaluation and a warm-up step (until both a first rollout and a
first update have run) are before the first stamp that counts. Once it has the lines it
needs, the script ends the run (its whole process group: flow_grpo's data loader workers
too). Rounds alternate, flow_grpo then ours, so a shared machine's changing load falls on
both; each round reports each side's median over its steps and their ratio, and the median
ratio over rounds. Ours runs in two variants (`--variants`): `ours`, the exact gradient of
the guided velocity (our default), and `ours_cfg_conditional` (`algorithm.cfg_gradient=
conditional`), flow_grpo's own update: it detaches CFG's unconditional pass, which ours then
runs apart without gradients instead of backpropagating zeros through it. Ours also reports
its own `time/*` metrics (rollout, reward wait, update, weight sync) as a cross-check.

What still differs, by each trainer's design: flow_grpo encodes the text of every sampling
batch (its 4 copies of one prompt through both CLIPs and T5), ours keeps each prompt's
conditioning; flow_grpo's minibatches are its sampling batches, each one prompt drawn at
random, so a step's two prompts are sometimes the same one (the work is the same: every
text is padded to its full length); a flow_grpo minibatch is 4 samples at all 10 steps, one
of ours is all 8 samples at 5 steps each (each sample's steps shuffled and split between the
minibatches): the same 80 transitions, passes and optimizer steps. Validation leaves the last
block's text query projection out of our LoRA (`SD3Family.unused_modules`): that block drops
its text outputs, so a LoRA there gets no gradient and changes no output, and our SD3 computes
that block's attention for the image tokens' queries only (`omni.models.sd3.ImageQueryAttention`).
Per-step log lines also carry each trainer's own logging (console lines here; wandb is disabled for flow_grpo).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {
    "prompts_per_step": 2, "images_per_prompt": 4, "denoising_steps": 10, "resolution": 64, "guidance_scale": 4.5,
    "noise_level": 0.7, "minibatches": 2, "clip_range": 1e-4, "lr": 3e-4, "lora_rank": 32, "lora_alpha": 64,
    "lora_targets": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
    "clip_length": 77, "t5_length": 128, "reward": "jpeg_compressibility", "dtype": "float32", "threads": 1,
}  # fmt: skip
PROMPTS = ["a red cat", "a blue dog", "a green tree", "a white house"]
EVAL_PROMPT = "a pink bird"
# The per-step line of each trainer, and how many of its first lines end set-up and warm-up
# (flow_grpo prints its first before any update has run, so one more of its lines is skipped).
# ours: the console logger's line, after the prefix of Hydra's log format
STEP_LINE = {"flow_grpo": re.compile(r"^advantages:"), "ours": re.compile(r"(^|\] - )step [1-9]\d*: .*time/update=")}
WARMUP_LINES = {"flow_grpo": 2, "ours": 1}
# Our trainer's variants, each timed in every round: the exact gradient of the guided velocity
# (the default), and flow_grpo's, which differentiates CFG's conditional pass only
# (`algorithm.cfg_gradient=conditional`: the same update as flow_grpo's, with less compute).
OUR_VARIANTS = {"ours": [], "ours_cfg_conditional": ["algorithm.cfg_gradient=conditional"]}

FLOW_GRPO_CONFIG = '''"""flow_grpo's config for bench_flow_grpo.py: its config/base.py with these fields set."""
import importlib.util


def get_config():
    spec = importlib.util.spec_from_file_location("flow_grpo_base_config", {base!r})
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    config = base.get_config()
    for dotted, value in {fields!r}.items():
        *parents, name = dotted.split(".")
        node = config
        for parent in parents:
            node = getattr(node, parent)
        if not hasattr(node, name):  # a misspelt field would be a new one that nothing reads
            raise KeyError(f"flow_grpo's config/base.py has no field {{dotted}}")
        setattr(node, name, value)
    return config
'''


def flow_grpo_fields(model_dir: Path, data_dir: Path, log_dir: Path) -> dict:
    """flow_grpo's config fields for SETTINGS: sampling batches of one prompt x 4 images, as
    many batches as minibatches (its minibatches are its sampling batches), an optimizer step
    per minibatch (accumulation over the 10 steps of one minibatch), evaluation and
    checkpoints never after the start (its evaluation at epoch 0 cannot be turned off: 1 prompt, 2 steps)."""
    s = SETTINGS
    images = s["prompts_per_step"] * s["images_per_prompt"]
    return {
        "pretrained.model": str(model_dir),
        "dataset": str(data_dir),
        "prompt_fn": "general_ocr",
        "reward_fn": {s["reward"]: 1.0},
        "logdir": str(log_dir),
        "mixed_precision": "no",
        "allow_tf32": False,
        "use_lora": True,
        "resolution": s["resolution"],
        "eval_freq": 10**9,
        "save_freq": 10**9,
        "sample.num_steps": s["denoising_steps"],
        "sample.eval_num_steps": 2,
        "sample.guidance_scale": s["guidance_scale"],
        "sample.noise_level": s["noise_level"],
        "sample.train_batch_size": images // s["minibatches"],
        "sample.num_image_per_prompt": s["images_per_prompt"],
        "sample.num_batches_per_epoch": s["minibatches"],
        "sample.test_batch_size": 1,
        "sample.global_std": True,
        "train.batch_size": images // s["minibatches"],
        "train.gradient_accumulation_steps": 1,
        "train.num_inner_epochs": 1,
        "train.timestep_fraction": 1.0,
        "train.clip_range": s["clip_range"],
        "train.learning_rate": s["lr"],
        "train.beta": 0.0,
        "train.ema": False,
        "train.cfg": True,
        "per_prompt_stat_tracking": True,
    }


def ours_overrides(model_dir: Path, data_dir: Path, run_dir: Path, steps: int) -> list:
    """recipes/train.py's Hydra overrides for SETTINGS (global reward std, as flow_grpo's)."""
    s = SETTINGS
    images = s["prompts_per_step"] * s["images_per_prompt"]
    return [
        "model=sd3", f"model.path={model_dir}", f"model.max_sequence_length={s['t5_length']}", "model.dtype=float32",
        f"model.lora.rank={s['lora_rank']}", f"model.lora.alpha={s['lora_alpha']}",
        f"model.lora.target_modules=[{','.join(s['lora_targets'])}]",
        f"rollout.num_steps={s['denoising_steps']}", f"rollout.resolution={s['resolution']}",
        f"rollout.guidance_scale={s['guidance_scale']}", f"rollout.noise_level={s['noise_level']}",
        f"rollout.micro_batch_size={images}", f"reward={s['reward']}", "logger=console",
        f"data.train={data_dir / 'train.txt'}", f"data.eval={data_dir / 'test.txt'}",
        f"trainer.batch_size={images}", f"trainer.micro_batch_size={images * s['denoising_steps'] // s['minibatches']}",
        f"algorithm.group_size={s['images_per_prompt']}", f"algorithm.num_minibatches={s['minibatches']}",
        f"algorithm.clip_range={s['clip_range']}", "algorithm.adv_norm=global", "algorithm.kl_coef=0",
        f"trainer.lr={s['lr']}", f"trainer.steps={steps}", "eval.every=0", "eval.images_per_prompt=1",
        "trainer.progress_bar=false", "logger.console_every=1", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def write_inputs(work: Path) -> tuple:
    """The tiny checkpoint and the prompt files (flow_grpo's dataset layout, which ours reads too)."""
    from omni.models.sd3 import write_tiny_sd3

    model_dir = write_tiny_sd3(
        work / "sd3-tiny", seed=0, clip_length=SETTINGS["clip_length"], t5_length=SETTINGS["t5_length"]
    )
    data_dir = work / "prompts"
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (data_dir / "test.txt").write_text(EVAL_PROMPT + "\n")
    return model_dir, data_dir


def model_dims(model_dir: Path) -> dict:
    config = lambda part: json.loads((model_dir / part / "config.json").read_text())  # noqa: E731
    transformer = config("transformer")
    keys = (
        "num_layers",
        "num_attention_heads",
        "attention_head_dim",
        "joint_attention_dim",
        "patch_size",
        "in_channels",
    )
    return {
        "transformer": {k: transformer[k] for k in keys},
        "clip_hidden_size": config("text_encoder")["hidden_size"],
        "clip_length": config("text_encoder")["max_position_embeddings"],
        "t5_d_model": config("text_encoder_3")["d_model"],
    }


def step_lines(cmd, cwd, env, pattern, count: int, timeout: float) -> list:
    """(perf_counter stamp, text) of the first `count` stdout lines of `cmd` that match
    `pattern`; then the run's process group is ended. A run that exits or times out first is
    an error naming the command, with the end of its stderr."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True
        )
        found, lines = [], queue.Queue()
        threading.Thread(target=stamp_lines, args=(proc.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            while len(found) < count:
                stamp, text = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
                if text is None:
                    break
                if pattern.search(text):
                    found.append((stamp, text))
        except queue.Empty:
            pass
        finally:
            end_group(proc)
        if len(found) < count:
            errors.seek(0)
            raise RuntimeError(
                f"{shlex.join(map(str, cmd))} (in {cwd}) printed {len(found)} of {count} step lines within "
                f"{timeout:.0f} s (exit code {proc.returncode}); the end of its stderr:\n{errors.read()[-3000:]}"
            )
    return found


def stamp_lines(stream, lines: queue.Queue) -> None:
    """Put (perf_counter, line) for each line of `stream` as it arrives, then (.., None) at its end."""
    for text in stream:
        lines.put((time.perf_counter(), text))
    lines.put((time.perf_counter(), None))


def end_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End the run and every process it started (it leads its own process group): SIGTERM,
    then after the leader has exited or `grace` seconds, SIGKILL to what is left; returns
    once none of them runs (at most `grace` seconds more), so the next run has the machine."""
    signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + grace
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list:
    """Pids of the live (not zombie) processes of process group `pgid` (Linux's /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def step_seconds(stamps: list, warmup_lines: int) -> list:
    """Seconds of each step after the first `warmup_lines` step lines: the differences of
    consecutive stamps from the last warm-up line on."""
    counted = stamps[warmup_lines - 1 :]
    return [b - a for a, b in zip(counted, counted[1:])]


def base_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled", **extra)
    return env


def torch_threads(python: str, env: dict) -> int:
    """torch's intra-op threads in `python` under `env` (so also: that python has torch)."""
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.get_num_threads())"], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"{python} cannot import torch (exit code {out.returncode}): {out.stderr[-1000:]}")
    return int(out.stdout.strip().splitlines()[-1])


@dataclass
class Side:
    """One trainer: its python, working directory, environment, and command for a round."""

    name: str
    python: str
    cwd: Path
    env: dict
    command: Callable[[int], list]
    kind: str = "flow_grpo"  # whose step lines (STEP_LINE, WARMUP_LINES)

    def shown(self) -> str:
        env = " ".join(
            f"{k}={self.env[k]}"
            for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED", "WANDB_MODE", "PYTHONPATH")
        )
        return f"cd {self.cwd} && {env} {shlex.join(map(str, self.command(0)))}"


def flow_grpo_side(checkout: Path, python: str, work: Path, model_dir: Path, data_dir: Path) -> Side:
    config = work / "flow_grpo_config.py"
    fields = flow_grpo_fields(model_dir, data_dir, work / "flow_grpo-logs")
    config.write_text(FLOW_GRPO_CONFIG.format(base=str(checkout / "config" / "base.py"), fields=fields))

    def command(round_index):  # the same run every round
        return [python, "scripts/train_sd3.py", "--config", str(config)]

    return Side("flow_grpo", python, checkout, base_env({"PYTHONPATH": str(checkout)}), command)


def ours_side(work: Path, model_dir: Path, data_dir: Path, steps: int, variant: str = "ours") -> Side:
    def command(round_index):
        run_dir = work / f"{variant}-round{round_index}"
        overrides = [*ours_overrides(model_dir, data_dir, run_dir, steps), *OUR_VARIANTS[variant]]
        return [sys.executable, str(REPO / "recipes" / "train.py"), *overrides]

    return Side(variant, sys.executable, REPO, base_env({"PYTHONPATH": str(REPO)}), command, kind="ours")


def measure(side: Side, round_index: int, steps: int, timeout: float) -> dict:
    """One run of `side`: its warm-up, then `steps` timed steps."""
    warmup = WARMUP_LINES[side.kind]
    found = step_lines(side.command(round_index), side.cwd, side.env, STEP_LINE[side.kind], warmup + steps, timeout)
    seconds = step_seconds([stamp for stamp, _ in found], warmup)
    result = {"seconds_per_step": [round(s, 4) for s in seconds], "median": statistics.median(seconds)}
    if side.kind == "ours":  # its own timings of the same steps
        timed = [dict(re.findall(r"(time/\w+)=([-+.\deE]+)", text)) for _, text in found[warmup:]]
        result["time_metrics_mean"] = {key: statistics.mean(float(t[key]) for t in timed) for key in sorted(timed[0])}
    return result


def summary(rounds: list, names: list) -> dict:
    report = {"rounds": rounds}
    for name in names:
        report[f"{name}_median_seconds_per_step"] = statistics.median(
            s for r in rounds for s in r[name]["seconds_per_step"]
        )
    if "flow_grpo" in names:
        for ours in (name for name in names if name != "flow_grpo"):
            for r in rounds:
                r[f"ratio_flow_grpo_over_{ours}"] = r["flow_grpo"]["median"] / r[ours]["median"]
            report[f"median_ratio_flow_grpo_over_{ours}"] = statistics.median(
                r[f"ratio_flow_grpo_over_{ours}"] for r in rounds
            )
    else:
        report["note"] = "flow_grpo not run (--flow-grpo not given): ours only"
    return report


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--flow-grpo", type=Path, help="a flow_grpo checkout (its scripts/train_sd3.py runs unmodified)"
    )
    parser.add_argument("--flow-grpo-python", default=sys.executable, help="a python with flow_grpo's dependencies")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each one run of each trainer (flow_grpo first)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after the warm-up")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument(
        "--variants", nargs="+", choices=OUR_VARIANTS, default=list(OUR_VARIANTS), help="our variants to time"
    )
    parser.add_argument(
        "--work-dir", type=Path, help="keep the checkpoint, configs and runs here (default: a temporary directory)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be at least 1 (got {args.rounds}, {args.steps})")
    if args.flow_grpo is not None:
        args.flow_grpo = args.flow_grpo.expanduser().resolve()
        for needed in ("scripts/train_sd3.py", "config/base.py"):
            if not (args.flow_grpo / needed).is_file():
                parser.error(f"--flow-grpo={args.flow_grpo}: no {needed} there (pass a flow_grpo checkout)")
        if not Path(args.flow_grpo_python).is_file():
            parser.error(f"--flow-grpo-python={args.flow_grpo_python}: no such file")
    return args


def run(args: argparse.Namespace, work: Path) -> dict:
    model_dir, data_dir = write_inputs(work)
    sides = [
        ours_side(work, model_dir, data_dir, WARMUP_LINES["ours"] + args.steps, variant) for variant in args.variants
    ]
    if args.flow_grpo is not None:
        sides.insert(0, flow_grpo_side(args.flow_grpo, args.flow_grpo_python, work, model_dir, data_dir))
    settings = {**SETTINGS, "model": model_dims(model_dir), "timed_steps_per_run": args.steps, "rounds": args.rounds,
                "torch_threads": {side.name: torch_threads(side.python, side.env) for side in sides},
                "commands": {side.name: side.shown() for side in sides}}  # fmt: skip
    rounds = [{side.name: measure(side, r, args.steps, args.timeout) for side in sides} for r in range(args.rounds)]
    return {"settings": settings, **summary(rounds, [side.name for side in sides])}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        report = run(args, args.work_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="bench-flow-grpo-") as work:
            report = run(args, Path(work))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
