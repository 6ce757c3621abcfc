"""How close an edit comes to its target where the edit changes the image: 1 - the mean
absolute pixel difference between the result and the target inside the changed region
(`omni.rewards.edit_regions`), in [0, 1]. Needs edits with a target image (an edit set row's
"target"); the toy recolour task (`experiment=recolor`) has one for every edit."""

import torch

from omni.data.prompts import source_images
from omni.rewards.base import Reward
from omni.rewards.edit_regions import EditRegionOptions, changed_region, mean_closeness, references


class EditTarget(Reward):
    Options = EditRegionOptions

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
