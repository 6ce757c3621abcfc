"""Schema of the `logger` group: console, wandb and tensorboard backends."""

from dataclasses import dataclass, field
from typing import List


@dataclass
class LoggerConfig:
    backends: List[str] = field(default_factory=lambda: ["console"])
    wandb_project: str = "omni-recipes"
    # offline by default: nothing leaves the machine unless the user asks.
    wandb_mode: str = "offline"
    # Print metrics to the console every N steps (the other backends get every step).
    console_every: int = 10
    # Log a grid of rollout images every N steps (0: never).
    image_every: int = 0
