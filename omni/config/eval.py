"""Schema of the `eval` group: the held-out evaluation (omni/evaluation.py), before training,
every `every` steps and after, and what `omni-evaluate` runs on a checkpoint.

The prompts are `prompts`, else `data.eval`, else the training prompts (with a warning: they
are not held out). Each prompt is sampled `images_per_prompt` times from seeds drawn from
`seed`, and the whole prompts that fit in `max_images` images are kept, in file order. The
sampler's fields left null are the rollout's (or the model's) values; `sde=false` samples the
deterministic ODE. Cross-group rules (a resolution the model takes, rewards that exist and
have what they need of each prompt) are omni.validation's.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from omni.config.errors import require

# Keys that left other groups for this one: the old key -> the new one.
MOVED_KEYS = {
    "trainer.eval_every": "eval.every",
    "trainer.eval_images_per_prompt": "eval.images_per_prompt",
    "trainer.eval_seed": "eval.seed",
}


def moved_key_message(key: str) -> Optional[str]:
    """What an old key given by the user is now (None: the key did not move)."""
    new = MOVED_KEYS.get(key)
    return None if new is None else f"{key} was moved: use {new}"


def moved_overrides(overrides) -> List[str]:
    """The messages for command-line overrides (`key=value`, `+key=...`, `~key`) of moved keys."""
    found = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        message = moved_key_message(key)
        if message is not None:
            found.append(message)
    return found


@dataclass
class EvalConfig:
    # A prompt set as data.eval takes it (a path, or omni:<name>); null: data.eval, and when that
    # is null too, the training prompts (not held out: a warning says so).
    prompts: Optional[str] = None
    # Evaluate every N training steps; 0: only before training and after it.
    every: int = 0
    # The seed the images' seeds are drawn from: the same images at every evaluation.
    seed: int = 12345
    images_per_prompt: int = 4
    # At most this many images an evaluation: the first prompts that fit, whole (each with its
    # images_per_prompt images), in the prompt file's order; null: every prompt.
    max_images: Optional[int] = 256
    # The sampler; null: the rollout's value (rollout.num_steps, rollout.guidance_scale,
    # rollout.resolution, which default to the model's).
    steps: Optional[int] = None
    guidance_scale: Optional[float] = None
    resolution: Optional[int] = None
    # Only null (each family's own negative prompt: SD3 "", Qwen-Image " ") is implemented;
    # another value is refused at validation rather than ignored.
    negative_prompt: Optional[str] = None
    # false: the deterministic ODE sampler; true: the rollout's SDE steps (rollout.noise_level,
    # rollout.sde_type) on every noisy step, as training samples.
    sde: bool = False
    # More rewards (names of omni/rewards/ modules, default options) scored on the held-out
    # images and logged as eval/<name>, never trained on; one the training reward already has
    # is scored once.
    rewards: List[str] = field(default_factory=list)
    # Held-out images logged at each evaluation with their prompts and scores (0: none).
    log_images: int = 8

    def __post_init__(self) -> None:
        """The rules on this group's own fields (see RolloutConfig.__post_init__)."""
        require(self.every >= 0, f"eval.every={self.every} must be >= 0 (0: only before and after training)")
        require(self.images_per_prompt >= 1, f"eval.images_per_prompt={self.images_per_prompt} must be >= 1")
        require(
            self.max_images is None or self.max_images >= self.images_per_prompt,
            f"eval.max_images={self.max_images} must be >= eval.images_per_prompt={self.images_per_prompt} "
            "(at least one whole prompt), or null for every prompt",
        )
        require(self.steps is None or self.steps >= 2, f"eval.steps={self.steps}: need at least 2, or null")
        require(
            self.guidance_scale is None or self.guidance_scale >= 0,
            f"eval.guidance_scale={self.guidance_scale} must be >= 0 (1 or less: no CFG), or null",
        )
        require(
            self.resolution is None or self.resolution > 0,
            f"eval.resolution={self.resolution} must be positive, or null",
        )
        require(
            self.negative_prompt is None,
            f"eval.negative_prompt={self.negative_prompt!r}: only null (the model family's own negative prompt) "
            "is implemented",
        )
        require(self.log_images >= 0, f"eval.log_images={self.log_images} must be >= 0 (0: none)")
        require(
            len(set(self.rewards)) == len(self.rewards),
            f"eval.rewards={list(self.rewards)} names a reward twice",
        )
