"""Schema of the `rollout` group: the engine that samples images and their log-probs."""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import MISSING


@dataclass
class RolloutConfig:
    engine: str = MISSING
    num_steps: int = 10
    # None: the model's native value (model.resolution, model.guidance_scale).
    resolution: Optional[int] = None
    guidance_scale: Optional[float] = None
    # Flow-GRPO's SDE noise scale (a in sigma_t = a * sqrt(t / (1 - t))).
    noise_level: float = 0.7
    # Images per engine forward pass.
    micro_batch_size: int = 16
    # The engine loads the base weights itself at start (else the first sync sends them).
    load_base: bool = True
    # Gather one FSDP unit at a time when syncing; needs the base already in the engine.
    layered_summon: bool = False
    # Engine-specific options passed through untouched (e.g. vLLM-Omni's).
    options: Dict[str, Any] = field(default_factory=dict)
