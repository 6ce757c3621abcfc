"""Schema of the `data` group: prompt sets (a text file, one prompt a line)."""

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class DataConfig:
    # A path, or `omni:<name>` for a prompt set shipped with the package.
    train: str = MISSING
    # Held-out prompts for evaluation; None: the train prompts.
    eval: Optional[str] = None
