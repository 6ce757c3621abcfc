"""Mean brightness of an image, in [0, 1]: the simplest reward a tiny model can learn."""

import torch

from omni.rewards.base import Reward


def brightness(images: torch.Tensor, prompts) -> torch.Tensor:
    return images.mean(dim=(1, 2, 3))


class Brightness(Reward):
    def score(self, images, prompts):
        return brightness(images, prompts)


REWARD = Brightness
