"""Checkpoints: the LoRA in diffusers' format plus the trainer state, written atomically.

Layout of `<output_dir>/checkpoints/step_000010/`:
    pytorch_lora_weights.safetensors   loadable by the family's pipeline (`load_lora_weights`)
    trainer_state.pt                   step, optimizer state, RNG states
A checkpoint is written to a temporary directory and renamed into place, and `latest` is
replaced only after that, so an interrupted save never damages what was already saved.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from omni.atomic import write_directory, write_text

LORA_FILE = "pytorch_lora_weights.safetensors"
STATE_FILE = "trainer_state.pt"


def rng_state() -> Dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_lora(directory: Path, lora: Dict[str, torch.Tensor], lora_config, family) -> None:
    """The LoRA as the family's diffusers pipeline saves it, with the adapter's PEFT config."""
    from omni.weights import peft_lora_config

    metadata = peft_lora_config(lora_config).to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    family.save_lora(directory, lora, metadata)


def save_checkpoint(root: Path, step: int, lora: Dict[str, torch.Tensor], lora_config, state: Dict[str, Any], family) -> Path:
    def write(tmp: Path) -> None:
        save_lora(tmp, lora, lora_config, family)
        torch.save({"step": step, **state}, tmp / STATE_FILE)

    final = write_directory(Path(root) / f"step_{step:06d}", write)
    write_text(Path(root) / "latest", final.name)
    return final


def latest_checkpoint(root: Path) -> Optional[Path]:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def load_checkpoint(directory: Path, family):
    """(PEFT-named LoRA tensors, trainer state) of a checkpoint directory."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file() or not (directory / LORA_FILE).is_file():
        raise FileNotFoundError(f"{directory}: not a checkpoint ({LORA_FILE} and {STATE_FILE} expected)")
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
    return family.load_lora(directory), state
