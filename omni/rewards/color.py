"""How close an image's mean colour is to the colour its prompt names (prompt-conditioned).

Score = 1 - distance between the image's mean RGB and the named colour, scaled to [0, 1].
A prompt naming no known colour scores 0, so such prompts cannot be rewarded by accident.
"""

import re

import torch

from omni.rewards.base import Reward

COLORS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 0.6, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "orange": (1.0, 0.55, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "pink": (1.0, 0.6, 0.75),
    "gray": (0.5, 0.5, 0.5),
}
_MAX_DISTANCE = 3**0.5


def named_color(prompt: str):
    for word in re.findall(r"[a-z]+", prompt.lower()):
        if word in COLORS:
            return COLORS[word]
    return None


def color(images: torch.Tensor, prompts) -> torch.Tensor:
    mean_rgb = images.mean(dim=(2, 3))
    scores = torch.zeros(len(prompts))
    for i, prompt in enumerate(prompts):
        target = named_color(prompt)
        if target is not None:
            distance = torch.linalg.vector_norm(mean_rgb[i] - torch.tensor(target))
            scores[i] = 1 - distance / _MAX_DISTANCE
    return scores


class Color(Reward):
    def score(self, images, prompts):
        return color(images, prompts)


REWARD = Color
