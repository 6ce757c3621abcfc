"""Rewards: one component per module (`omni/rewards/<name>.py` defines `REWARD`, see
`omni.rewards.base`), combined by `WeightedReward` into a weighted sum whose components are
each reported under what they measure (`reward/<metric>`: `Reward.metric`, and a component's
details as `reward/<metric>/<detail>`)."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch
from omegaconf import OmegaConf

from omni.registry import Registry
from omni.rewards.base import Reward, RewardOptions

REWARDS = Registry(__name__, "REWARD", "reward", "reward.components")


def reward_options(name: str, raw, key: str = "reward.components") -> RewardOptions:
    """The typed options of component `name` from its config entry (a dict or options);
    an unknown reward, option or wrong type raises ValueError naming `key.name`."""
    cls = REWARDS.get(name)
    if isinstance(raw, cls.Options):
        return raw
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls.Options), raw or {}))
    except Exception as error:  # omegaconf's ValidationError / ConfigKeyError / MissingMandatoryValue
        raise ValueError(
            f"{key}.{name}: {str(error).splitlines()[0]}; options of '{name}': "
            f"{list(OmegaConf.structured(cls.Options))}"
        ) from None


class NonFiniteReward(ValueError):
    """A reward gave NaN or inf (with reward.nonfinite=fail)."""


class WeightedReward:
    """The weighted sum of the configured components, each scored in chunks of its batch size."""

    def __init__(self, components: Mapping[str, object], batch_size: int = 64, nonfinite: str = "fail"):
        if not components:
            raise ValueError(f"reward.components is empty: name at least one reward, one of {REWARDS.names()}")
        self.rewards: Dict[str, Reward] = {}
        for name, raw in components.items():
            options = reward_options(name, raw)
            self.rewards[name] = REWARDS.get(name)(name, options)
        metrics = [reward.metric for reward in self.rewards.values()]
        if len(set(metrics)) < len(metrics) or "reward" in metrics:
            raise ValueError(f"reward.components {list(self.rewards)} would be logged under the same name: {metrics}")
        self.batch_size = batch_size
        self.nonfinite = nonfinite

    @property
    def weights(self) -> Dict[str, float]:
        """Each component's weight, by the name its scores go under (`Reward.metric`)."""
        return {reward.metric: reward.options.weight for reward in self.rewards.values()}

    def setup(self) -> None:
        for reward in self.rewards.values():
            reward.setup()

    def teardown(self) -> None:
        for reward in self.rewards.values():
            reward.teardown()

    def _score(self, reward: Reward, images: torch.Tensor, prompts: List[str]) -> Dict[str, torch.Tensor]:
        """The reward's scores under its metric name and its details under <metric>/<detail>."""
        size = reward.options.batch_size or self.batch_size
        parts = []
        for s in range(0, len(prompts), size):
            scores, details = reward.score_details(images[s : s + size].float().cpu(), prompts[s : s + size])
            parts.append(
                {reward.metric: scores.float(), **{f"{reward.metric}/{k}": v.float() for k, v in details.items()}}
            )
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}

    def component_scores(self, images: torch.Tensor, prompts: List[str]) -> Dict[str, torch.Tensor]:
        """Each component's scores by its metric name (and its details), from calls of at most its batch size."""
        return {
            key: values
            for reward in self.rewards.values()
            for key, values in self._score(reward, images, prompts).items()
        }

    def combine(self, parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """The `component_scores` of consecutive parts as one, with their weighted sum as "reward"."""
        scores = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        scores["reward"] = sum(weight * scores[metric] for metric, weight in self.weights.items())
        return scores

    def finite(self, scores: Dict[str, torch.Tensor], where: str) -> torch.Tensor:
        """The images whose reward is finite. With nonfinite=fail, any other stops here with
        an error naming the components, `where` and how many images."""
        valid = torch.isfinite(scores["reward"])
        if self.nonfinite == "fail" and not valid.all():
            bad = {name: int((~torch.isfinite(scores[reward.metric])).sum()) for name, reward in self.rewards.items()}
            named = ", ".join(
                f"'{n}'{self.rewards[n].source()} on {k} of {len(valid)} images" for n, k in bad.items() if k
            )
            raise NonFiniteReward(
                f"non-finite reward during {where}: {named or f'the weighted sum on {int((~valid).sum())} images'}; "
                f"reward.nonfinite=drop leaves such images out instead"
            )
        return valid

    def __call__(self, images: torch.Tensor, prompts: List[str], part: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """Returns {"reward": total, <name>: component} with one value per image. With `part`,
        rows [0, part), [part, 2 part), ... are scored separately, as a rollout's parts are
        (`omni.rewards.streaming`), so that a reward's batches are the same either way."""
        part = part or max(len(prompts), 1)
        return self.combine(
            [self.component_scores(images[s : s + part], prompts[s : s + part]) for s in range(0, len(prompts), part)]
        )
