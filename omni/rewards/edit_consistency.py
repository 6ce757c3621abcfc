"""How much an edit keeps of its source: 1 - the mean absolute pixel difference between the
result and the source outside the region the edit changes (`omni.rewards.edit_regions`), in
[0, 1]. Without a target or a mask the whole image counts, so the score then rewards leaving
the source alone: pair it with a reward for doing the edit (`edit_target`, a judge)."""

from dataclasses import dataclass

import torch

from omni.data.prompts import source_images
from omni.rewards.base import Reward, RewardOptions
from omni.rewards.edit_regions import changed_region, mean_closeness, references


@dataclass
class EditConsistencyOptions(RewardOptions):
    # A pixel belongs to the changed region when the target differs from the source there by
    # more than this (in [0, 1], any channel).
    threshold: float = 0.1


class EditConsistency(Reward):
    Options = EditConsistencyOptions

    @classmethod
    def prompt_problem(cls, options, prompt):
        return None if source_images(prompt) else "a source image (an edit set row's 'image' or 'images')"

    def score(self, images, prompts):
        scores = []
        for image, prompt in zip(images, prompts):
            source, target = references(prompt, image.shape[-2:])
            kept = ~changed_region(prompt, source, target, self.options.threshold)
            scores.append(mean_closeness(image, source, kept))
        return torch.tensor(scores, dtype=torch.float32)


REWARD = EditConsistency
