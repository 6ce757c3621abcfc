"""What the CLIP-based rewards share (`pickscore`, `clipscore`, `aesthetic`): a CLIP model and
its processor loaded with `transformers` from local directories, on a device, and the
unit-length image and text embeddings of a batch.

Options (`reward.components.<name>.<option>`): `path` (the model directory, required),
`processor_path` (when the processor lives elsewhere, as PickScore's does), `device`,
`dtype`. A path that is not a model directory fails at validation, naming the key, before
any model loads. Images reach the processor as 8-bit RGB, as a saved image would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
from omegaconf import MISSING

from omni.devices import DTYPES
from omni.rewards.base import Reward, RewardOptions
from omni.rewards.protocol import to_uint8
from omni.rewards.weights_files import check_weights_dir, load_error


@dataclass
class ClipOptions(RewardOptions):
    # Directory of the CLIP model (config.json + weights), as save_pretrained writes it.
    path: str = MISSING
    # Directory of its processor (tokenizer + image processor); None: `path`.
    processor_path: Optional[str] = None
    # Where the reward model runs ("cpu", "cuda", "cuda:1").
    device: str = "cpu"
    # float32, bfloat16 or float16.
    dtype: str = "float32"


def check_model_dir(path: Optional[str], key: str) -> None:
    if path is None:
        return
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(f"{key}={path}: not a model directory (no config.json there); save one with save_pretrained")
    check_weights_dir(directory, key, key.split(".")[-2] if key.count(".") >= 2 else key)


def pooled(features: Any) -> torch.Tensor:
    """transformers 4 returns the projected embedding; 5 returns it as `pooler_output`."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


class ClipReward(Reward):
    Options = ClipOptions

    @classmethod
    def check_options(cls, options: ClipOptions, key: str) -> None:
        check_model_dir(options.path, f"{key}.path")
        check_model_dir(options.processor_path, f"{key}.processor_path")
        if options.dtype not in DTYPES:
            raise ValueError(f"{key}.dtype={options.dtype}: expected one of {list(DTYPES)}")

    def setup(self) -> None:
        from transformers import AutoProcessor, CLIPModel

        options = self.options
        self.device = torch.device(options.device)
        self.processor = AutoProcessor.from_pretrained(str(Path(options.processor_path or options.path).expanduser()))
        try:
            model = CLIPModel.from_pretrained(str(Path(options.path).expanduser()))
        except (OSError, RuntimeError, ValueError) as error:  # a weights file damaged after validation
            raise load_error(options.path, f"reward.components.{self.name}.path", self.name, error) from None
        self.model = model.to(self.device, DTYPES[options.dtype]).eval().requires_grad_(False)

    def teardown(self) -> None:
        self.model = self.processor = None

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [0, 1] -> (B, D) unit vectors, in fp32."""
        pixels = self.processor(images=[to_uint8(image) for image in images], return_tensors="pt")["pixel_values"]
        features = pooled(self.model.get_image_features(pixel_values=pixels.to(self.device, self.model.dtype)))
        return torch.nn.functional.normalize(features.float(), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: List[str]) -> torch.Tensor:
        """Prompts -> (B, D) unit vectors, in fp32 (truncated to the text model's length)."""
        tokens = self.processor(text=[str(p) for p in prompts], padding=True, truncation=True, return_tensors="pt")
        tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        return torch.nn.functional.normalize(pooled(self.model.get_text_features(**tokens)).float(), dim=-1)
