"""Mean brightness of an image, in [0, 1]: the simplest reward a tiny model can learn."""

import torch


def brightness(images: torch.Tensor, prompts) -> torch.Tensor:
    return images.mean(dim=(1, 2, 3))
