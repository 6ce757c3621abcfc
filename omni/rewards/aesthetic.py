"""The LAION aesthetic predictor (v2, "improved aesthetic predictor"): an MLP on the unit-length
CLIP ViT-L/14 image embedding, trained to predict human aesthetic ratings (1-10).

    score = MLP(normalize(CLIP image embedding))

The MLP is 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (dropout between the first layers, no
activations, as released); its weights are read from `head_path` (the released
`sac+logos+ava1-l14-linearMSE.pth`, or the same state dict as .safetensors), its input size
from the CLIP model's projection size.

    python recipes/train.py reward=aesthetic reward.components.aesthetic.path=/ckpt/clip-vit-large-patch14 \\
        reward.components.aesthetic.head_path=/ckpt/sac+logos+ava1-l14-linearMSE.pth
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from torch import nn

from omni.devices import DTYPES
from omni.rewards.clip_base import ClipOptions, ClipReward
from omni.rewards.weights_files import check_weights_file, load_error


@dataclass
class AestheticOptions(ClipOptions):
    # The MLP head's state dict (.pth / .pt / .safetensors): keys layers.{0,2,4,6,7}.{weight,bias}.
    head_path: str = MISSING


class AestheticHead(nn.Module):
    """The released MLP; the Dropout layers keep the released state dict's layer indices."""

    def __init__(self, embedding_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embedding_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings)


def load_head(path: str, embedding_size: int, name: str = "aesthetic") -> AestheticHead:
    """The head with the weights of `path`; a file that does not read or fit names reward
    `name`, the file and the problem."""
    path = Path(path).expanduser()
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors' / torch's / pickle's errors for a damaged file
        raise load_error(path, f"reward.components.{name}.head_path", name, error) from None
    head = AestheticHead(embedding_size)
    try:
        head.load_state_dict(state)
    except RuntimeError as error:
        raise ValueError(
            f"head_path={path}: not an aesthetic head for {embedding_size}-d CLIP embeddings: {error}"
        ) from None
    return head


class Aesthetic(ClipReward):
    Options = AestheticOptions

    @classmethod
    def check_options(cls, options: AestheticOptions, key: str) -> None:
        super().check_options(options, key)
        if not Path(options.head_path).expanduser().is_file():
            raise ValueError(f"{key}.head_path={options.head_path}: no such file (the aesthetic MLP's weights)")
        check_weights_file(options.head_path, f"{key}.head_path", key.split(".")[-1])

    def setup(self) -> None:
        super().setup()
        head = load_head(self.options.head_path, self.model.config.projection_dim, self.name)
        self.head = head.to(self.device, DTYPES[self.options.dtype]).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, images, prompts):
        embeddings = self.image_embeddings(images).to(self.head.layers[0].weight.dtype)
        return self.head(embeddings).squeeze(-1).float().cpu()


REWARD = Aesthetic
