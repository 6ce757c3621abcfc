"""Schema of the `logger` group: console, wandb and tensorboard backends."""

from dataclasses import dataclass, field
from enum import Enum
from typing import List


class LoggerBackend(str, Enum):
    console = "console"
    wandb = "wandb"
    tensorboard = "tensorboard"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    backends: List[LoggerBackend] = field(default_factory=lambda: [LoggerBackend.console])
    wandb_project: str = "omni-recipes"
    # offline by default: nothing leaves the machine unless the user asks.
    wandb_mode: WandbMode = WandbMode.offline
    # Print metrics to the console every N steps (the other backends get every step).
    console_every: int = 10
    # Log a grid of rollout images every N steps (0: never).
    image_every: int = 0
