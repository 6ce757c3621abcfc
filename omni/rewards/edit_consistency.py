"""How much an edit keeps of its source: 1 - the mean absolute pixel difference between the
result and the source outside the region the edit changes (`omni.rewards.edit_regions`), in
[0, 1]. Without a target or a mask the whole image counts, so the score then rewards leaving
the source alone: pair it with a reward for doing the edit (`edit_target`, a judge)."""

import torch

from omni.data.prompts import source_images
from omni.rewards.base import Reward
from omni.rewards.edit_regions import EditRegionOptions, changed_region, mean_closeness, references


class EditConsistency(Reward):
    Options = EditRegionOptions

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
