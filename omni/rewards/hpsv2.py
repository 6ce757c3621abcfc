"""HPS v2 / v2.1 (Wu et al. 2023, Human Preference Score): an open_clip ViT-H-14 fine-tuned on
human preferences between generated images (HPD v2).

    score = cos(image embedding, prompt embedding)

the cosine of open_clip's normalised embeddings (about 0.2-0.35; no logit scale, as HPS v2
reports it). The weights are the released checkpoint in a local file (`path`:
HPS_v2.1_compressed.pt, a dict whose `state_dict` is the model's); nothing is downloaded:
the architecture is built from open_clip's own config (`architecture`: ViT-H-14, or an
open_clip model config JSON file) and its tokenizer ships with open_clip. Images are
preprocessed as HPS v2 does it (open_clip's evaluation transform on 8-bit RGB images).

Needs the `hpsv2` extra (open_clip_torch), which needs a torchvision built for the installed
torch; where there is none (a CPU-only torch 2.13 has no torchvision on PyPI), serve this
reward from an environment that has one and train with `reward=http` (docs/reward_server.md):

    python -m omni.rewards.serve reward=hpsv2 reward.components.hpsv2.path=/ckpt/HPS_v2.1_compressed.pt --port 8000
    python recipes/train.py reward=hpsv2 reward.components.hpsv2.path=/ckpt/HPS_v2.1_compressed.pt \\
        reward.components.hpsv2.device=cuda
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from PIL import Image

from omni.devices import DTYPES
from omni.rewards.base import Reward, RewardOptions
from omni.rewards.protocol import to_uint8
from omni.rewards.weights_files import check_weights_file

INSTALL = (
    "pip install -e '.[hpsv2]' (open_clip_torch; it needs a torchvision built for this torch), "
    "or serve the reward from an environment that has it and train with reward=http (docs/reward_server.md)"
)


@dataclass
class HpsOptions(RewardOptions):
    # The HPS checkpoint file (HPS_v2.1_compressed.pt or HPS_v2_compressed.pt).
    path: str = MISSING
    # open_clip architecture: a model name open_clip knows, or a model config JSON file.
    architecture: str = "ViT-H-14"
    # Where the reward model runs ("cpu", "cuda", "cuda:1").
    device: str = "cpu"
    # float32, bfloat16 or float16.
    dtype: str = "float32"


def import_open_clip():
    try:
        import open_clip
    except (ImportError, RuntimeError) as error:  # RuntimeError: a torchvision built for another torch
        raise ImportError(f"reward 'hpsv2' needs open_clip, which does not import here ({error}): {INSTALL}") from None
    return open_clip


def model_name(open_clip, architecture: str) -> str:
    """The open_clip model name of `architecture`, registering a config file under its stem."""
    path = Path(architecture).expanduser()
    if path.suffix != ".json":
        return architecture
    open_clip.add_model_config(path)
    return path.stem


def load_state(path: str, name: str = "hpsv2") -> dict:
    """The model's state dict from a released HPS checkpoint (`{"state_dict": ...}`, keys with
    or without DistributedDataParallel's `module.` prefix) or a bare state dict."""
    try:
        checkpoint = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip or weights-only errors: say which file
        raise ValueError(
            f"reward.components.{name}.path={path}: reward '{name}' cannot read this HPS checkpoint with torch.load "
            f"({error})"
        ) from None
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"path={path}: expected a state dict, or a dict with one under 'state_dict'")
    return {key.removeprefix("module."): value for key, value in state.items()}


class Hpsv2(Reward):
    Options = HpsOptions

    @classmethod
    def check_options(cls, options: HpsOptions, key: str) -> None:
        if not Path(options.path).expanduser().is_file():
            raise ValueError(
                f"{key}.path={options.path}: no such file (the HPS checkpoint, e.g. HPS_v2.1_compressed.pt)"
            )
        if options.architecture.endswith(".json") and not Path(options.architecture).expanduser().is_file():
            raise ValueError(f"{key}.architecture={options.architecture}: no such open_clip model config file")
        if options.dtype not in DTYPES:
            raise ValueError(f"{key}.dtype={options.dtype}: expected one of {list(DTYPES)}")
        check_weights_file(options.path, f"{key}.path", key.split(".")[-1])

    def setup(self) -> None:
        open_clip = import_open_clip()
        options = self.options
        name = model_name(open_clip, options.architecture)
        model, _, self.preprocess = open_clip.create_model_and_transforms(name, pretrained=None)
        try:
            model.load_state_dict(load_state(options.path, self.name))
        except RuntimeError as error:
            raise ValueError(
                f"reward.components.{self.name}.path={options.path}: not an HPS checkpoint of {name}: "
                f"{str(error)[:300]}"
            ) from None
        self.device = torch.device(options.device)
        self.model = model.to(self.device, DTYPES[options.dtype]).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(name)

    def teardown(self) -> None:
        self.model = self.preprocess = self.tokenizer = None

    @torch.no_grad()
    def score(self, images, prompts):
        dtype = next(self.model.parameters()).dtype
        pixels = torch.stack([self.preprocess(Image.fromarray(to_uint8(image))) for image in images])
        image = self.model.encode_image(pixels.to(self.device, dtype), normalize=True)
        text = self.model.encode_text(self.tokenizer([str(p) for p in prompts]).to(self.device), normalize=True)
        return (image.float() * text.float()).sum(dim=-1).cpu()


REWARD = Hpsv2
