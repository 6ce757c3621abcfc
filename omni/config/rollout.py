"""Schema of the `rollout` group: the engine that samples images and their log-probs.

What every engine takes; an engine with options of its own declares them in its module
(`Options`, a subclass of `RolloutConfig`, stored as `schema/rollout/<engine>`)."""

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import List, Optional

from omegaconf import MISSING

from omni.config.errors import require
from omni.registry import entry_points


def engine_names() -> List[str]:
    """The rollout engines: the modules omni/rollout/<engine>_engine.py, listed without
    importing them (so a new engine is a new module, and a misspelt one still fails at
    composition, naming `rollout.engine`)."""
    found = {
        path.name[: -len("_engine.py")]
        for path in (Path(__file__).resolve().parents[1] / "rollout").glob("*_engine.py")
    }
    # and a plugin's engine: an entry point of omni_recipes.rollout (see omni.registry)
    return sorted(found | {name for name, _ in entry_points("omni_recipes.rollout")})


# The closed set of `rollout.engine`, discovered (an engine's options and checks are in its module).
Engine = Enum("Engine", [(name, name) for name in engine_names()], type=str, module=__name__)


class SDEType(str, Enum):
    """The stochastic step that rollouts take and the actor re-scores (omni/rollout/sde.py)."""

    sde = "sde"  # Flow-GRPO's ODE-to-SDE step
    cps = "cps"  # Coefficients-Preserving Sampling: DDIM's noise coefficients kept


class InitialNoise(str, Enum):
    """Where a grouped rollout's images take their initial noise (omni.rollout.sampling)."""

    per_image = "per_image"  # each its own: a group's images start apart (Flow-GRPO)
    # one per group: a group's images start from the same noise and part only by their SDE
    # steps, the noise the update's log-probs credit (DanceGRPO's shared initial noise)
    per_group = "per_group"


class ODESolverType(str, Enum):
    """The solver of the deterministic (ODE) sampling steps (omni/rollout/ode.py)."""

    euler = "euler"  # first order
    dpm2 = "dpm2"  # DPM-Solver++(2M), multistep second order: MixGRPO-Flash's ODE steps


@dataclass
class ParityConfig:
    """`rollout.parity`: the gate that checks, after a weight sync, that an engine with weights
    of its own (rollout.share_actor=false, rollout=vllm) samples with the policy the actor
    trains (omni/rollout/parity.py). The engine samples a probe, the actor re-scores it."""

    # Which syncs are checked: the first two (the set-up's, the first after an update), then
    # every `every`-th (10: syncs 1, 2, 10, 20, ...); 1: every sync; 0: none (the gate is off).
    every: int = 10
    # Images of the probe rollout (fixed prompts, the run's sampling options, every noisy step
    # stochastic).
    images: int = 2
    # Tolerances on the probe's importance ratios (actor over engine, each SDE step of each
    # image): their mean |ratio - 1| and their largest |log-prob difference|. A healthy sync's
    # noise floor with the actor's kernels (diffusers; vllm with backend vllm or local): in bf16
    # on an H200 ~2e-8 mean and ~2.4e-7 largest (docs/benchmarks/gpu/2026-12-04b.json), under
    # 1e-6 on the CPU (tests/rollout/test_bf16.py), 0 in fp32 on the CPU. The defaults sit 500x
    # and 400x above the H200 floor and 10x below Flow-GRPO's clip range (1e-4), a mismatch
    # that would already bend its updates. The vLLM `native` backend's kernels differ from
    # the actor's (1.3e-4 mean, 7.6e-4 largest in bf16 on the tiny SD3 on a CPU, README): the
    # gate stops such a run unless these are raised, knowingly.
    max_mean_ratio_deviation: float = 1e-5
    max_log_prob_diff: float = 1e-4

    def __post_init__(self) -> None:
        require(self.every >= 0, f"rollout.parity.every={self.every} must be >= 0 (0: the gate is off)")
        require(self.images >= 1, f"rollout.parity.images={self.images} must be >= 1")
        for key in ("max_mean_ratio_deviation", "max_log_prob_diff"):
            value = getattr(self, key)
            require(value > 0, f"rollout.parity.{key}={value} must be positive")


@dataclass
class RolloutConfig:
    engine: Engine = MISSING
    num_steps: int = 10
    # None: the model's native value (model.resolution, model.guidance_scale).
    resolution: Optional[int] = None
    guidance_scale: Optional[float] = None
    # Frames per clip of a video model (Wan: 4k+1) and the frame rate its videos are saved
    # and logged at; None: the model's (model.num_frames, model.fps; 1 for image models).
    num_frames: Optional[int] = None
    fps: Optional[int] = None
    # The stochastic step of SDE-based algorithms (see SDEType).
    sde_type: SDEType = SDEType.sde
    # Its noise scale: a in sigma_t = a * sqrt(t / (1 - t)) for sde; eta in (0, 1] for cps,
    # whose step to t' has std t' sin(eta pi / 2).
    noise_level: float = 0.7
    # Where the images of a prompt's group take their initial noise (see InitialNoise);
    # per_group needs stochastic (SDE) rollouts, or a group's images would all be one.
    initial_noise: InitialNoise = InitialNoise.per_image
    # The solver of every ODE step: outside an SDE window, and every step of ODE sampling
    # (evaluation, DiffusionNFT's and online DPO's rollouts). See ODESolverType.
    ode_solver: ODESolverType = ODESolverType.euler
    # Images per engine forward pass.
    micro_batch_size: int = 16
    # The engine loads the base weights itself at start (else the first sync sends them).
    load_base: bool = True
    # Gather one FSDP unit at a time when syncing; needs the base already in the engine.
    layered_summon: bool = False
    # The in-process engine samples with the actor's own transformer: one copy per device
    # and no weight sync. None: wherever that is possible (rollout.engine=diffusers with one
    # worker, FSDP2 or a replicated base); false: the engine loads its own copy, synced.
    share_actor: Optional[bool] = None
    # Keep the text encoders on the CPU between encodings (each prompt's conditioning is
    # cached); they visit the device only to encode prompts not seen lately.
    offload_text_encoders: bool = True
    # The actor-engine parity gate after weight syncs (an engine with its own weights only).
    parity: ParityConfig = field(default_factory=ParityConfig)

    def __post_init__(self) -> None:
        """The rules on this group's own fields, run when validation builds the schema objects
        (before any model loads); rules across groups are omni.validation's."""
        require(self.num_steps >= 2, f"rollout.num_steps={self.num_steps}: need at least 2")
        require(self.noise_level > 0, f"rollout.noise_level={self.noise_level} must be positive")
        require(
            self.sde_type != SDEType.cps or self.noise_level <= 1,
            f"rollout.noise_level={self.noise_level} with rollout.sde_type=cps: CPS's eta must be in (0, 1] "
            f"(its step to sigma' has std sigma' sin(eta pi / 2))",
        )
        require(self.micro_batch_size > 0, "rollout.micro_batch_size must be positive")
        require(self.fps is None or self.fps > 0, f"rollout.fps={self.fps} must be positive")
        require(
            self.guidance_scale is None or self.guidance_scale >= 0,
            f"rollout.guidance_scale={self.guidance_scale} must be >= 0 (1 or less: no CFG)",
        )
        require(
            not (self.layered_summon and not self.load_base),
            "rollout.layered_summon=true needs the base weights already in the engine, but "
            "rollout.load_base=false starts it without them; set rollout.load_base=true or layered_summon=false",
        )
