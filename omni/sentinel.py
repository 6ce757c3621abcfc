"""The reward-hacking sentinel: what each evaluation's images show beyond the training reward.

A reward can rise for the wrong reason: the images get brighter, or lose their colours or
edges, while what the reward stands for gets worse. At each evaluation (the same held-out
prompts and seeds every time) the sentinel measures, per image,
  - statistics of the images that no reward asked for (`STATISTICS`: brightness, saturation,
    colour entropy, dark-pixel fraction, edge density) and the norm of the final latent;
  - `gold` rewards (`sentinel.gold`), scored on the same images and never trained on;
and compares them with the base evaluation, the first one (before training; a resumed run
keeps its base in the checkpoint). Two rules, each on or off (`omni.config.sentinel`):
  - gold: the training reward's mean rose while a gold reward's fell by more than k standard
    errors of the paired change, se = sd(now - base) / sqrt(n) over the images finite in both;
  - statistic: a watched statistic's mean moved by more than k standard deviations of the
    base images' values of it.
A rule that fires at an evaluation yields a `Finding` naming the rule, the step and the
figures; the trainer then warns, stops or rolls back (`sentinel.action`): reloads the newest
checkpoint saved at an evaluation where no rule fired (`held`), scales the learning rate by
`sentinel.lr_factor`, and trains on from there. Every measured figure is logged under
sentinel/ (`Evaluation.metrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from omni.config.sentinel import SentinelAction, SentinelConfig, Statistic

LUMA = (0.299, 0.587, 0.114)
DARK = 0.1  # luma below which a pixel is dark
EDGE = 0.1  # luma gradient (central differences) above which a pixel is on an edge
COLOR_LEVELS = 4  # colour entropy: levels a channel, so 64 colours


def luma(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, H, W)."""
    weights = torch.tensor(LUMA, dtype=images.dtype, device=images.device)
    return torch.einsum("bchw,c->bhw", images, weights)


def brightness(images: torch.Tensor) -> torch.Tensor:
    return luma(images).mean(dim=(1, 2))


def saturation(images: torch.Tensor) -> torch.Tensor:
    high, low = images.amax(dim=1), images.amin(dim=1)
    return torch.where(high > 1e-6, (high - low) / high.clamp_min(1e-6), torch.zeros_like(high)).mean(dim=(1, 2))


def color_entropy(images: torch.Tensor) -> torch.Tensor:
    """Entropy in bits of each image's histogram of quantised colours."""
    levels = (images.clamp(0, 1) * COLOR_LEVELS).long().clamp_max(COLOR_LEVELS - 1)
    codes = (levels[:, 0] * COLOR_LEVELS + levels[:, 1]) * COLOR_LEVELS + levels[:, 2]
    counts = torch.stack([torch.bincount(c.flatten(), minlength=COLOR_LEVELS**3) for c in codes]).float()
    p = counts / counts.sum(dim=1, keepdim=True)
    return -(p * torch.log2(p.clamp_min(1e-12))).sum(dim=1)


def dark_fraction(images: torch.Tensor) -> torch.Tensor:
    return (luma(images) < DARK).float().mean(dim=(1, 2))


def edge_density(images: torch.Tensor) -> torch.Tensor:
    y = luma(images)
    gx = (y[:, 1:-1, 2:] - y[:, 1:-1, :-2]) / 2
    gy = (y[:, 2:, 1:-1] - y[:, :-2, 1:-1]) / 2
    return ((gx**2 + gy**2).sqrt() > EDGE).float().mean(dim=(1, 2))


def latent_norm(latents: torch.Tensor) -> torch.Tensor:
    """Root mean square of each row of the final latents (any layout, one row per image)."""
    flat = latents.flatten(1).float()
    return flat.norm(dim=1) / math.sqrt(flat.shape[1])


# The statistics of the images: (B, 3, H, W) in [0, 1] -> (B,).
STATISTICS: Dict[Statistic, Callable[[torch.Tensor], torch.Tensor]] = {
    Statistic.brightness: brightness,
    Statistic.saturation: saturation,
    Statistic.color_entropy: color_entropy,
    Statistic.dark_fraction: dark_fraction,
    Statistic.edge_density: edge_density,
}


def image_statistics(images: torch.Tensor, latents: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Every statistic per image; clips (B, F, 3, H, W) get the mean over their frames."""
    images = images.float().cpu()
    frames = images.flatten(0, 1) if images.ndim == 5 else images
    stats = {}
    for name, fn in STATISTICS.items():
        values = fn(frames)
        stats[name.value] = values.view(images.shape[0], -1).mean(dim=1) if images.ndim == 5 else values
    stats[Statistic.latent_norm.value] = latent_norm(latents.cpu())
    return stats


@dataclass
class Evaluation:
    """One evaluation's per-image figures (the same prompts and seeds at every evaluation;
    NaN where an image's reward was not finite)."""

    step: int
    reward: torch.Tensor
    gold: Dict[str, torch.Tensor]
    stats: Dict[str, torch.Tensor]

    def state_dict(self) -> dict:
        return {"step": self.step, "reward": self.reward, "gold": self.gold, "stats": self.stats}

    @staticmethod
    def from_state(state: dict) -> "Evaluation":
        return Evaluation(state["step"], state["reward"], dict(state["gold"]), dict(state["stats"]))


def paired_change(base: torch.Tensor, now: torch.Tensor):
    """(mean change, its standard error, n) over the images finite in both."""
    both = torch.isfinite(base) & torch.isfinite(now)
    d = (now[both] - base[both]).double()
    n = int(both.sum())
    if n < 2:
        return float(d.mean()) if n else 0.0, math.inf, n
    return float(d.mean()), float(d.std() / math.sqrt(n)), n


def finite_mean(values: torch.Tensor) -> float:
    values = values[torch.isfinite(values)]
    return float(values.double().mean()) if len(values) else math.nan


@dataclass
class Finding:
    """A rule that fired at an evaluation, with its figures."""

    rule: str  # "gold" or "statistic"
    name: str  # the gold reward or the statistic
    step: int
    message: str


def gold_findings(base: Evaluation, now: Evaluation, k: float) -> List[Finding]:
    """The gold rule: the training reward's mean rose while a gold reward fell by > k se."""
    reward_change, _, _ = paired_change(base.reward, now.reward)
    if reward_change <= 0:
        return []
    found = []
    for name, values in now.gold.items():
        change, se, n = paired_change(base.gold[name], values)
        if change < 0 and change < -k * se:
            found.append(
                Finding(
                    "gold",
                    name,
                    now.step,
                    f"sentinel rule 'gold' fired at step {now.step}: the training reward rose by {reward_change:+.4g} "
                    f"({finite_mean(base.reward):.4g} -> {finite_mean(now.reward):.4g}) while gold reward '{name}' "
                    f"fell by {change:+.4g} ({finite_mean(base.gold[name]):.4g} -> {finite_mean(values):.4g}), "
                    f"{-change / se:.3g} standard errors (se {se:.3g} over {n} images; "
                    f"sentinel.gold_drop_se={k:g}), since the base evaluation at step {base.step}",
                )
            )
    return found


def statistic_findings(base: Evaluation, now: Evaluation, k: float, watch) -> List[Finding]:
    """The statistic rule: a watched statistic's mean moved by > k sd of the base images'."""
    found = []
    for stat in watch:
        name = Statistic(stat).value
        shift, sd = stat_shift(base.stats[name], now.stats[name])
        if abs(shift) > k * sd:
            found.append(
                Finding(
                    "statistic",
                    name,
                    now.step,
                    f"sentinel rule 'statistic' fired at step {now.step}: {name} moved by {shift:+.4g} "
                    f"({finite_mean(base.stats[name]):.4g} -> {finite_mean(now.stats[name]):.4g}), "
                    f"{abs(shift) / sd if sd > 0 else math.inf:.3g} standard deviations of the base images' "
                    f"(sd {sd:.3g}; sentinel.stat_shift_sd={k:g}), since the base evaluation at step {base.step}",
                )
            )
    return found


def stat_shift(base: torch.Tensor, now: torch.Tensor):
    """(change of the mean, sd of the base values) over the finite values of each."""
    base = base[torch.isfinite(base)].double()
    shift = finite_mean(now) - float(base.mean())
    return shift, float(base.std()) if len(base) > 1 else 0.0


@dataclass
class Sentinel:
    """The rules' state over a run: the base evaluation, the steps whose evaluation held (no
    rule fired), and the rollbacks made with the learning rate's scale they left."""

    cfg: SentinelConfig
    base: Optional[Evaluation] = None
    held: List[int] = field(default_factory=list)
    rollbacks: int = 0
    lr_scale: float = 1.0

    def judge(self, now: Evaluation) -> List[Finding]:
        """The findings of `now` (the first evaluation becomes the base and finds nothing)."""
        if self.base is None:
            self.base = now
            self.held.append(now.step)
            return []
        found = []
        if self.cfg.gold_drop_se is not None:
            found += gold_findings(self.base, now, self.cfg.gold_drop_se)
        if self.cfg.stat_shift_sd is not None:
            found += statistic_findings(self.base, now, self.cfg.stat_shift_sd, self.cfg.watch)
        if not found:
            self.held.append(now.step)
        return found

    def metrics(self, now: Evaluation, found: List[Finding]) -> Dict[str, float]:
        """Everything measured at `now`, for the loggers: each statistic's mean and its shift
        in base sd, each gold reward's mean and its paired change in standard errors, the
        training reward's change, whether a rule fired, the rollbacks and the lr's scale."""
        metrics = {f"sentinel/{name}": finite_mean(values) for name, values in now.stats.items()}
        metrics.update({f"sentinel/gold/{name}": finite_mean(values) for name, values in now.gold.items()})
        base = self.base if self.base is not None else now
        for name, values in now.stats.items():
            shift, sd = stat_shift(base.stats[name], values)
            metrics[f"sentinel/{name}/shift_sd"] = shift / sd if sd > 0 else 0.0
        for name, values in now.gold.items():
            change, se, _ = paired_change(base.gold[name], values)
            metrics[f"sentinel/gold/{name}/change"] = change
            metrics[f"sentinel/gold/{name}/change_se"] = change / se if 0 < se < math.inf else 0.0
        metrics["sentinel/reward_change"] = paired_change(base.reward, now.reward)[0]
        metrics["sentinel/fired"] = float(bool(found))
        metrics["sentinel/rollbacks"] = float(self.rollbacks)
        metrics["sentinel/lr_scale"] = self.lr_scale
        return metrics

    def can_roll_back(self) -> bool:
        return self.cfg.action == SentinelAction.rollback and self.rollbacks < self.cfg.max_rollbacks

    def state_dict(self) -> dict:
        return {
            "base": None if self.base is None else self.base.state_dict(),
            "held": list(self.held),
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; a checkpoint saved without the sentinel leaves it as it is
        (the first evaluation after resuming becomes the base)."""
        if not state:
            return
        self.base = None if state["base"] is None else Evaluation.from_state(state["base"])
        self.held = list(state["held"])
        self.rollbacks, self.lr_scale = state["rollbacks"], state["lr_scale"]


def check_config(cfg, family) -> None:
    """The sentinel's rules across groups, at validation (ConfigError naming the keys): each
    gold reward typed in place (`sentinel.gold.<name>`), its files there, of the family's kind
    (images or clips), with what it needs of every held-out prompt; a rule that can fire; and
    for a rollback, checkpoints saved at evaluations."""
    from omni.config.errors import ConfigError, require
    from omni.data.prompt_sets import load_prompt_set
    from omni.evaluation import prompt_source
    from omni.rewards import REWARDS, reward_options

    sentinel, trainer, every = cfg.sentinel, cfg.trainer, cfg.eval.every
    if not sentinel.enabled:
        return
    for name in list(sentinel.gold):
        require(name in REWARDS.names(), f"sentinel.gold.{name}: no such reward; available: {REWARDS.names()}")
        try:
            sentinel.gold[name] = reward_options(name, sentinel.gold[name], "sentinel.gold")
            REWARDS.get(name).check_options(sentinel.gold[name], f"sentinel.gold.{name}")
        except (KeyError, ValueError) as error:
            raise ConfigError(error.args[0]) from None
        kind = "clips" if REWARDS.get(name).video else "images"
        require(
            REWARDS.get(name).video == family.video,
            f"sentinel.gold.{name} scores {kind} but model.family={family.name} makes "
            f"{'clips' if family.video else 'images'}",
        )
    spec, key = prompt_source(cfg)
    prompts = load_prompt_set(spec, key, cfg.data.skip_bad_rows) if sentinel.gold else []
    for name, options in sentinel.gold.items():
        for prompt in prompts:
            problem = REWARDS.get(name).prompt_problem(options, prompt)
            require(
                problem is None,
                f"{key}={spec}: {prompt.origin}: sentinel.gold.{name} needs {problem}; "
                f"the prompt is {str(prompt)[:100]!r}",
            )
    require(
        (sentinel.gold and sentinel.gold_drop_se is not None) or sentinel.stat_shift_sd is not None,
        f"sentinel.enabled=true but no rule can fire: give gold rewards (sentinel.gold, with "
        f"sentinel.gold_drop_se={sentinel.gold_drop_se}) or set sentinel.stat_shift_sd",
    )
    if sentinel.action == SentinelAction.rollback:
        require(
            every > 0 and trainer.save_every > 0 and trainer.save_every % every == 0,
            f"sentinel.action=rollback with eval.every={every} and trainer.save_every="
            f"{trainer.save_every}: a rollback reloads a checkpoint saved at an evaluation where the rules held, so "
            "set both > 0 with trainer.save_every a multiple of eval.every",
        )
