"""Benchmark the tiny Flow-GRPO and DPO recipes on this machine; prints one JSON object.

    python scripts/bench_train.py [--repeats 5] [--threads 1] [--parts rollout update ...]
                                  [hydra overrides, e.g. model=flux_tiny]
    python scripts/bench_train.py --reward-overlap [--repeats 3]

Every figure comes with the settings it ran with (model, images, steps, resolution, CFG,
text lengths, micro-batches, threads), read from the run's composed config and its
tokenizers, and every comparison is of the same work timed in this run: figures measured
with other settings or on another day are not comparable.

- rollout: images/s of our engine (SDE steps with log-probs, trajectory kept, text encoded
  every call) against the plain diffusers pipeline (`__call__`) on the same model, batch,
  steps, size, guidance and text length; also ours with each prompt's text conditioning
  cached, as a training run samples (not in the ratio); a video model's clips are also
  counted in frames/s, and the pipeline makes clips of the same frame count;
- update: Flow-GRPO training transitions (sample x step) per second;
- step: seconds per Flow-GRPO training step (rollout + reward + update + weight sync) of
  `trainer.batch_size` images (8 unless overridden, 4 per prompt), with its phases;
- roofline: the step's FLOPs per phase (counted by torch's FlopCounterMode) over its seconds,
  against this machine's fp32 matmul rate at the same threads (omni/bench/roofline.py);
- dpo: seconds per preference pair of an offline DPO update.
With --reward-overlap, only this: Flow-GRPO steps (8 images in 4 parts of 2) with a reward
made as slow as the rollout (brightness after a sleep, as a remote judge would wait), with
`reward.overlap` off and on: with it on, the step should take about the longer of rollout
and reward, not their sum.
Best of `repeats` timings after a warm-up, so other load on the machine inflates less (the
rollout's three timings interleaved, so that load falls on each alike).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from omni.algorithms import flow_grpo
from omni.bench.roofline import roofline
from omni.composing import compose_train
from omni.context import step_seeds
from omni.rewards.base import Reward, RewardOptions
from omni.rewards.brightness import brightness
from omni.trainer import Trainer
from omni.validation import validate


def fastest(fn, repeats: int):
    """(seconds, result) of the fastest of `repeats` calls of `fn`, after a warm-up call."""
    fn()
    timed = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        timed.append((time.perf_counter() - start, result))
    return min(timed, key=lambda pair: pair[0])


def best_time(fn, repeats: int) -> float:
    return fastest(fn, repeats)[0]


def best_times_interleaved(fns, repeats: int) -> list:
    """The fastest of `repeats` calls of each of `fns`, called in turn (after a warm-up call of
    each), so a shared machine's load, which comes and goes, falls on all of them alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def make_trainer(out_dir: str, *overrides: str) -> Trainer:
    cfg = compose_train([f"output_dir={out_dir}", "trainer.progress_bar=false", *overrides])
    trainer = Trainer(validate(cfg))
    trainer.setup()
    return trainer


def text_lengths(trainer: Trainer) -> dict:
    """The text conditioning's sequence lengths (dimension 1 of each of the family's
    conditioning tensors: SD3's joint CLIP + T5 sequence, FLUX's T5, ...) for one prompt,
    as the transformer sees them."""
    cfg = trainer.cfg
    cond = trainer.worker.encode_prompts(["a red cat"], cfg.rollout.guidance_scale, cfg.model.max_sequence_length)
    return {name: t.shape[1] for name, t in cond.tensors().items() if t.ndim >= 3}


def settings(trainer: Trainer) -> dict:
    """What a figure of this trainer measured: the work and the threads."""
    cfg = trainer.cfg
    return {
        "model": cfg.model.family,
        "images_per_step": cfg.trainer.batch_size,
        "images_per_prompt": cfg.algorithm.group_size,
        "steps": cfg.rollout.num_steps,
        "resolution": cfg.rollout.resolution,
        "guidance_scale": cfg.rollout.guidance_scale,
        "max_sequence_length": cfg.model.max_sequence_length,
        "text_tokens": text_lengths(trainer),
        "rollout_micro_batch": cfg.rollout.micro_batch_size,
        "update_micro_batch": cfg.trainer.micro_batch_size,
        "num_minibatches": cfg.algorithm.num_minibatches,
        "lora_rank": cfg.model.lora.rank if cfg.model.lora else None,
        "torch_threads": torch.get_num_threads(),
    }


def bench_rollout(trainer: Trainer, n_images: int, repeats: int) -> dict:
    options = trainer.ctx.sampling_options(trainer.ctx.sde_window(0))
    prompts = ["a red cat", "a blue dog"] * (n_images // 2)
    seeds = step_seeds(0, 0, n_images)
    engine = trainer.worker.engine
    pipe = engine.pipe
    video = trainer.family.video
    frames = {"num_frames": options.num_frames} if video else {}  # the same clips from the plain pipeline

    def ours():
        engine.prompts.rows.clear()  # the text encoders run every call, as the pipeline's do
        engine.generate(prompts, seeds, options)

    def ours_cached():  # each prompt's text conditioning kept from the last call, as in training
        engine.generate(prompts, seeds, options)

    def plain():
        with torch.no_grad():
            pipe(
                prompts,
                num_inference_steps=options.num_steps,
                height=options.resolution,
                width=options.resolution,
                max_sequence_length=options.max_sequence_length,
                generator=[torch.Generator().manual_seed(s) for s in seeds],
                output_type="pt",
                **trainer.family.pipeline_guidance(options.guidance_scale),
                **frames,
            )

    ours_s, cached_s, plain_s = best_times_interleaved([ours, ours_cached, plain], repeats)
    clips = {}
    if video:
        clips = {"frames": options.num_frames, "ours_frames_per_s": n_images * options.num_frames / ours_s,
                 "ours_cached_text_frames_per_s": n_images * options.num_frames / cached_s,
                 "diffusers_pipeline_frames_per_s": n_images * options.num_frames / plain_s}  # fmt: skip
    return {
        "images": n_images,
        "ours_images_per_s": n_images / ours_s,
        "ours_cached_text_images_per_s": n_images / cached_s,
        "diffusers_pipeline_images_per_s": n_images / plain_s,
        **clips,
        "ratio_vs_pipeline": plain_s / ours_s,
    }


def bench_update(trainer: Trainer, repeats: int) -> dict:
    options = trainer.ctx.sampling_options(trainer.ctx.sde_window(0))
    batch = flow_grpo.GRPOBatch(
        trainer.worker.generate(["a red cat"] * 8, list(range(8)), options), torch.linspace(-1, 1, 8)
    )
    seconds = best_time(lambda: trainer.worker.apply_update(flow_grpo.update, batch, seed=0), repeats)
    transitions = len(batch) * options.num_steps * trainer.cfg.algorithm.num_inner_epochs
    return {"transitions_per_s": transitions / seconds, "samples_per_s": len(batch) / seconds}


def bench_step(trainer: Trainer, repeats: int) -> dict:
    counter = iter(range(10_000))
    seconds, metrics = fastest(lambda: trainer.algorithm.step(next(counter)), repeats)
    return {"seconds_per_step": seconds, **{key: metrics[key] for key in sorted(metrics) if key.startswith("time/")}}


def bench_roofline(trainer: Trainer, repeats: int) -> dict:
    counter = iter(range(10_000))

    def step():
        tick = time.perf_counter()
        metrics = trainer.algorithm.step(next(counter))
        return {**metrics, "step": time.perf_counter() - tick}

    _, metrics = fastest(step, repeats)
    seconds = {key: metrics[key] for key in metrics if key.startswith("time/") or key == "step"}
    return roofline(trainer, seconds, next(counter))


def bench_dpo(out_dir: str, repeats: int, overrides=()) -> dict:
    from omni.data.synthetic_pairs import write_synthetic_pairs

    pairs = write_synthetic_pairs(Path(out_dir) / "pairs", n_pairs=40, resolution=64, seed=0)
    # the VAE's encoder, as a trained VAE encodes (the tiny model's decoder inversion is a stand-in)
    trainer = make_trainer(
        out_dir,
        *overrides,
        "algorithm=dpo",
        "data=pairs",
        f"data.pairs={pairs}",
        "trainer.batch_size=16",
        "model.vae_inversion_steps=0",
    )
    counter = iter(range(10_000))
    seconds = best_time(lambda: trainer.algorithm.step(next(counter)), repeats)
    result = {
        "settings": settings(trainer),
        "pairs_per_step": 16,
        "seconds_per_step": seconds,
        "seconds_per_pair": seconds / 16,
    }
    trainer.cleanup()
    return result


class Delayed(Reward):
    """Brightness after a sleep of `seconds` per image: a reward as slow as wanted, which,
    like a reward server or a model on another device, leaves the interpreter free while it waits."""

    def __init__(self, seconds: float):
        super().__init__("delayed", RewardOptions())
        self.seconds = seconds

    def score(self, images, prompts):
        time.sleep(self.seconds * len(images))
        return brightness(images, prompts)


def bench_reward_overlap(out_dir: str, repeats: int, overrides=()) -> dict:
    trainer = make_trainer(
        out_dir, *overrides, "trainer.batch_size=8", "algorithm.group_size=4", "rollout.micro_batch_size=2"
    )
    options = trainer.ctx.sampling_options(trainer.ctx.sde_window(0))
    rollout_s = best_time(lambda: trainer.worker.generate(["a red cat"] * 8, step_seeds(0, 0, 8), options), repeats)
    trainer.ctx.reward.rewards = {"delayed": Delayed(rollout_s / 8)}  # as slow as the rollout
    counter, result = (
        iter(range(10_000)),
        {"settings": {**settings(trainer), "reward_seconds_per_image": rollout_s / 8}},
    )
    for overlap in (False, True):
        trainer.cfg.reward.overlap = overlap
        seconds, metrics = fastest(lambda: trainer.algorithm.step(next(counter)), repeats)
        other = metrics["time/update"] + metrics["time/sync"]
        result[f"overlap_{'on' if overlap else 'off'}"] = {
            "seconds_per_step": seconds,
            **{
                key: metrics[key]
                for key in ("time/rollout", "time/reward", "time/reward_wait", "time/update", "time/sync")
            },
            "longer_of_rollout_and_reward_plus_update": max(metrics["time/rollout"], metrics["time/reward"]) + other,
            "sum_of_rollout_and_reward_plus_update": metrics["time/rollout"] + metrics["time/reward"] + other,
        }
    trainer.cleanup()
    result["ratio_on_over_off"] = result["overlap_on"]["seconds_per_step"] / result["overlap_off"]["seconds_per_step"]
    return result


PARTS = {
    "rollout": lambda trainer, repeats: bench_rollout(trainer, 8, repeats),
    "update": bench_update,
    "step": bench_step,
    "roofline": bench_roofline,
    "dpo": None,  # builds its own trainer
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reward-overlap", action="store_true", help="only the reward.overlap benchmark")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which benchmarks to run (default: all)"
    )
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    args, overrides = parser.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out_dir:
        if args.reward_overlap:
            print(json.dumps(bench_reward_overlap(out_dir, args.repeats, overrides), indent=2))
            return
        result = {}
        on_trainer = [part for part in ("rollout", "update", "step", "roofline") if part in args.parts]
        if on_trainer:
            trainer = make_trainer(out_dir, "trainer.batch_size=8", "algorithm.group_size=4", *overrides)
            result["settings"] = settings(trainer)
            for part in on_trainer:
                result[part] = PARTS[part](trainer, args.repeats)
            trainer.cleanup()
        if "dpo" in args.parts:
            result["dpo"] = bench_dpo(out_dir, args.repeats, overrides)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
