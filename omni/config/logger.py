"""Schema of the `logger` group: console, wandb, tensorboard and mlflow backends.

wandb, tensorboard and mlflow are optional installs (`pip install 'omni-recipes[wandb]'`, ...,
or `[loggers]` for all three); validation names the extra of a chosen backend that is missing.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from omni.config.errors import require


class LoggerBackend(str, Enum):
    console = "console"
    wandb = "wandb"
    tensorboard = "tensorboard"
    mlflow = "mlflow"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    backends: List[LoggerBackend] = field(default_factory=lambda: [LoggerBackend.console])
    # The run's name, group and tags in wandb (name, group, tags) and mlflow (run name, the
    # experiment = the group, tags); tensorboard records them as a text summary `run`.
    # None: the backend's own (wandb's random name, mlflow's default experiment).
    run_name: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    wandb_project: str = "omni-recipes"
    # offline by default: nothing leaves the machine unless the user asks.
    wandb_mode: WandbMode = WandbMode.offline
    # Where mlflow records the run; None: a file store in the run directory (`mlruns/`).
    mlflow_tracking_uri: Optional[str] = None
    # Print metrics to the console every N steps (the other backends get every step).
    console_every: int = 10
    # Log a grid of rollout images every N steps (0: never).
    image_every: int = 0

    def __post_init__(self) -> None:
        """The cadences (see RolloutConfig.__post_init__); installed backends are omni.validation's."""
        require(self.console_every >= 1, f"logger.console_every={self.console_every} must be >= 1")
        require(self.image_every >= 0, f"logger.image_every={self.image_every} must be >= 0")
