"""How close an edit comes to its target where the edit changes the image: 1 - the mean
absolute pixel difference between the result and the target inside the changed region
(`omni.rewards.edit_regions`), in [0, 1]. Needs edits with a target image (an edit set row's
"target"); the toy recolour task (`experiment=recolor`) has one for every edit."""

from dataclasses import dataclass

import torch

from omni.data.prompts import source_images
from omni.rewards.base import Reward, RewardOptions
from omni.rewards.edit_regions import changed_region, mean_closeness, references


@dataclass
class EditTargetOptions(RewardOptions):
    # A pixel belongs to the changed region when the target differs from the source there by
    # more than this (in [0, 1], any channel).
    threshold: float = 0.1


class EditTarget(Reward):
    Options = EditTargetOptions

    @classmethod
    def prompt_problem(cls, options, prompt):
        if not source_images(prompt):
            return "a source image (an edit set row's 'image' or 'images')"
        if "target" not in getattr(prompt, "metadata", {}):
            return "a target image (an edit set row's 'target')"
        return None

    def score(self, images, prompts):
        scores = []
        for image, prompt in zip(images, prompts):
            source, target = references(prompt, image.shape[-2:])
            changed = changed_region(prompt, source, target, self.options.threshold)
            scores.append(mean_closeness(image, target, changed))
        return torch.tensor(scores, dtype=torch.float32)


REWARD = EditTarget
