"""Evaluation on held-out prompts and seeds (the `eval` group, omni/config/eval.py).

The prompts are `eval.prompts`, else `data.eval`, else the training prompts (a warning says
they are not held out). Each is repeated `eval.images_per_prompt` times, the whole prompts
that fit in `eval.max_images` images are kept (the first ones, in file order: the same at
every evaluation), and the images' seeds are drawn once from `eval.seed`. Every evaluation
samples these (prompt, seed) pairs with the evaluation's sampler (by default the
deterministic ODE) and scores them with the training reward and `eval.rewards`.

An `EvalResult` holds the per-image prompts, categories, seeds and scores, a few images to
log, and the means per category when the prompts carry one (a `tag`: the scene / GenEval
categories single_object, two_object, counting, colors, position, color_attr; or DrawBench's
`category`). Its metrics are `eval/<reward>` and `eval/<reward>/<category>`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from omni.context import step_seeds
from omni.data.prompt_sets import load_prompt_set
from omni.data.prompts import Prompt
from omni.rewards import WeightedReward, reward_options
from omni.rollout.base import SamplingOptions, run_sampling_options
from omni.rollout.sde import noisy_steps

logger = logging.getLogger(__name__)

# The metadata keys that name a prompt's category, in order of preference.
CATEGORY_KEYS = ("tag", "category")
OVERALL = "all"


def prompt_source(cfg) -> Tuple[str, str]:
    """(spec, key) of the evaluation's prompts: eval.prompts, data.eval, or data.train."""
    if cfg.eval.prompts:
        return cfg.eval.prompts, "eval.prompts"
    if cfg.data.eval:
        return cfg.data.eval, "data.eval"
    return cfg.data.train, "data.train"


def load_eval_prompts(cfg) -> List[Prompt]:
    spec, key = prompt_source(cfg)
    prompts = load_prompt_set(spec, key, cfg.data.skip_bad_rows)
    if key == "data.train":
        cap = cfg.eval.max_images
        logger.warning(
            "evaluating on the training prompts (eval.prompts and data.eval are null: %s=%s, %d prompts, %s): "
            "they are not held out; set data.eval or eval.prompts",
            key,
            spec,
            len(prompts),
            f"at most {cap} images (eval.max_images)" if cap is not None else "every one (eval.max_images=null)",
        )
    return prompts


def plan(eval_cfg, prompts: Sequence[Prompt]) -> Tuple[List[Prompt], List[int]]:
    """The prompt and seed of each image: each prompt `images_per_prompt` times, the first
    whole prompts that fit in `max_images` (logged when some are left out)."""
    n = eval_cfg.images_per_prompt
    keep = len(prompts) if eval_cfg.max_images is None else min(len(prompts), eval_cfg.max_images // n)
    if keep < len(prompts):
        logger.info(
            "evaluation: the first %d of %d prompts x %d images (eval.max_images=%d; null for every prompt)",
            keep,
            len(prompts),
            n,
            eval_cfg.max_images,
        )
    images = [p for p in prompts[:keep] for _ in range(n)]
    return images, step_seeds(eval_cfg.seed, 0, len(images))


def sampling_options(cfg) -> SamplingOptions:
    """The run's sampling with the evaluation's sampler fields (of a validated config, whose
    nulls took the rollout's values); with `eval.sde`, every noisy step is the rollout's SDE
    step, else the deterministic ODE."""
    e = cfg.eval
    sde = noisy_steps(SimpleNamespace(num_steps=e.steps, sde_type=cfg.rollout.sde_type)) if e.sde else 0
    return dataclasses.replace(
        run_sampling_options(cfg),
        num_steps=e.steps,
        guidance_scale=e.guidance_scale,
        resolution=e.resolution,
        sde_steps=(0, sde),
    )


def category(prompt) -> Optional[str]:
    metadata = getattr(prompt, "metadata", {})
    return next((str(metadata[k]) for k in CATEGORY_KEYS if metadata.get(k)), None)


def category_means(scores: Dict[str, torch.Tensor], tags: Sequence[Optional[str]]) -> Dict[str, Dict[str, float]]:
    """reward -> category -> the mean of its finite scores on the images of that category
    (categories in order of first appearance); {} when no prompt has a category."""
    names = list(dict.fromkeys(t for t in tags if t is not None))
    if not names:
        return {}
    result = {}
    for reward, values in scores.items():
        result[reward] = {}
        for name in names:
            mask = torch.tensor([t == name for t in tags])
            result[reward][name] = finite_mean(values[mask])
    return result


def finite_mean(values: torch.Tensor) -> float:
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if len(finite) else math.nan


@dataclass
class EvalResult:
    """One evaluation: per image its prompt, category (None without one), seed and scores
    (NaN where the reward was not finite and reward.nonfinite=drop left it out)."""

    step: int
    prompts: List[str]
    tags: List[Optional[str]]
    seeds: List[int]
    scores: Dict[str, torch.Tensor]
    images: Optional[torch.Tensor] = None  # the first eval.log_images images, for the logger
    categories: Dict[str, Dict[str, float]] = field(default_factory=dict)

    def mean(self, reward: str = "reward") -> float:
        return finite_mean(self.scores[reward])

    def valid(self, reward: str = "reward") -> torch.Tensor:
        values = self.scores[reward]
        return values[torch.isfinite(values)]

    def metrics(self) -> Dict[str, float]:
        metrics = {f"eval/{name}": self.mean(name) for name in self.scores}
        for name, per_category in self.categories.items():
            metrics.update({f"eval/{name}/{tag}": value for tag, value in per_category.items()})
        return metrics

    def summary(self) -> dict:
        """What `omni-evaluate` writes (eval.json): the overall means, per category, per image."""
        as_json = lambda x: None if not math.isfinite(x) else x  # noqa: E731
        return {
            "step": self.step,
            "images": len(self.prompts),
            "overall": {name: as_json(self.mean(name)) for name in self.scores},
            "categories": {r: {t: as_json(v) for t, v in c.items()} for r, c in self.categories.items()},
            "per_image": [
                {"prompt": str(p), "tag": t, "seed": s, **{n: as_json(float(v[i])) for n, v in self.scores.items()}}
                for i, (p, t, s) in enumerate(zip(self.prompts, self.tags, self.seeds))
            ],
        }

    def table(self) -> str:
        """The means per category (rows) and reward (columns), then the overall row."""
        rewards = list(self.scores)
        rows = [(tag, [self.categories[r][tag] for r in rewards], self.tags.count(tag)) for tag in self.categories.get(
            rewards[0], {})]  # fmt: skip
        rows.append((OVERALL, [self.mean(r) for r in rewards], len(self.prompts)))
        width = max(len("category"), *(len(tag) for tag, _, _ in rows))
        columns = [max(len(r), 8) for r in rewards]
        lines = ["  ".join([f"{'category':<{width}}", *(f"{r:>{w}}" for r, w in zip(rewards, columns)), "images"])]
        for tag, values, n in rows:
            lines.append("  ".join([f"{tag:<{width}}", *(f"{v:>{w}.4f}" for v, w in zip(values, columns)), f"{n:>6}"]))
        return "\n".join(lines)


def headline_scores(result: EvalResult) -> List[str]:
    """The scores a run's closing table shows: the training reward, then each reward's 0/1
    accuracy where it logs one (`<reward>/accuracy`, GenEval's)."""
    return ["reward", *(name for name in result.scores if name.endswith("/accuracy"))]


def before_after_table(initial: EvalResult, final: EvalResult) -> str:
    """Each headline score before and after training, per category (rows) and overall, from two
    evaluations of the same (prompt, seed) pairs."""
    names = headline_scores(final)
    tags = list(final.categories.get(names[0], {}))
    rows = [(tag, [(initial.categories[n][tag], final.categories[n][tag]) for n in names]) for tag in tags]
    rows.append((OVERALL, [(initial.mean(n), final.mean(n)) for n in names]))
    width = max(len("category"), *(len(tag) for tag, _ in rows))
    cell = len("0.0000 -> 0.0000 (+0.0000)")
    columns = [max(len(n), cell) for n in names]
    lines = ["  ".join([f"{'category':<{width}}", *(f"{n:>{w}}" for n, w in zip(names, columns))])]
    for tag, pairs in rows:
        cells = (f"{b:.4f} -> {a:.4f} ({a - b:+.4f})" for b, a in pairs)
        lines.append("  ".join([f"{tag:<{width}}", *(f"{c:>{w}}" for c, w in zip(cells, columns))]))
    return "\n".join(lines)


class Evaluator:
    """The evaluation of a run: its (prompt, seed) pairs fixed at construction, sampled and
    scored by `run` with the run's worker and reward (`ctx`, an omni.context.StepContext)."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.prompts, self.seeds = plan(cfg.eval, ctx.eval_prompts)
        extra = {
            name: reward_options(name, {}, "eval.rewards")
            for name in cfg.eval.rewards
            if name not in cfg.reward.components
        }
        self.extra = WeightedReward(extra, cfg.reward.batch_size) if extra else None

    def setup(self) -> None:
        if self.extra is not None:
            self.extra.setup()

    def close(self) -> None:
        if self.extra is not None:
            self.extra.teardown()

    def run(self, step: int, where: str = "the evaluation") -> Tuple[EvalResult, torch.Tensor, torch.Tensor]:
        """The result at `step`, every image and every final latent (for the sentinel)."""
        cfg, prompts = self.cfg, self.prompts
        options = sampling_options(cfg)
        chunk = 4 * cfg.rollout.micro_batch_size * cfg.trainer.n_workers
        images, latents, parts = [], [], []
        bar = tqdm(
            total=len(prompts),
            desc=f"eval step {step}",
            unit="img",
            leave=False,
            disable=not cfg.trainer.progress_bar or len(prompts) <= chunk,
        )
        with bar:
            for start in range(0, len(prompts), chunk):
                rows = slice(start, start + chunk)
                batch, scores, _ = self.ctx.sample_and_score(prompts[rows], self.seeds[rows], options)
                images.append(batch.images)
                latents.append(batch.latents[:, -1])
                parts.append(scores)
                bar.update(len(batch))
        images, latents = torch.cat(images), torch.cat(latents)
        scores = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        valid = self.ctx.reward.finite(scores, where)
        scores = {name: torch.where(valid, v, torch.full_like(v, math.nan)) for name, v in scores.items()}
        if self.extra is not None:
            scores.update(self.extra.component_scores(images, prompts))
        tags = [category(p) for p in prompts]
        result = EvalResult(
            step=step,
            prompts=[str(p) for p in prompts],
            tags=tags,
            seeds=list(self.seeds),
            scores=scores,
            images=images[: cfg.eval.log_images].cpu() if cfg.eval.log_images else None,
            categories=category_means(scores, tags),
        )
        return result, images, latents
