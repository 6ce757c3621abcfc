"""Schema of the `rollout` group: the engine that samples images and their log-probs."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from omegaconf import MISSING


class Engine(str, Enum):
    """A module omni/rollout/<engine>_engine.py."""

    diffusers = "diffusers"
    vllm = "vllm"


class VllmBackend(str, Enum):
    vllm = "vllm"  # vLLM-Omni serves our pipeline
    native = "native"  # vLLM-Omni's own pipeline of the family, with our SDE scheduler (SD3, FLUX, Qwen-Image)
    local = "local"  # the same pipeline in the engine process without vLLM-Omni (tests, debugging)


class SDEType(str, Enum):
    """The stochastic step that rollouts take and the actor re-scores (omni/rollout/sde.py)."""

    sde = "sde"  # Flow-GRPO's ODE-to-SDE step
    cps = "cps"  # Coefficients-Preserving Sampling: DDIM's noise coefficients kept


class ODESolverType(str, Enum):
    """The solver of the deterministic (ODE) sampling steps (omni/rollout/ode.py)."""

    euler = "euler"  # first order
    dpm2 = "dpm2"  # DPM-Solver++(2M), multistep second order: MixGRPO-Flash's ODE steps


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


def shares_actor(cfg) -> bool:
    """Whether the engine samples with the actor's transformer (`rollout.share_actor`)."""
    possible = Engine(cfg.rollout.engine) == Engine.diffusers and (cfg.trainer.n_workers == 1 or cfg.model.fsdp.version in (None, 0, 2))
    return possible if cfg.rollout.share_actor is None else cfg.rollout.share_actor


@dataclass
class VllmOptions:
    """`rollout.options` of rollout=vllm (see omni/rollout/vllm_engine.py)."""

    # Attach to a running engine (http://host:port) instead of starting one.
    url: Optional[str] = None
    # Python of the engine's environment; default: $OMNI_VLLM_PYTHON, then the env that
    # scripts/install_vllm_engine.sh creates, then this python if it has vllm_omni.
    python: Optional[str] = None
    # Where weight syncs are written; the engine must be able to read it (default: run dir).
    shared_dir: Optional[str] = None
    backend: VllmBackend = VllmBackend.vllm
    startup_timeout: float = 1800.0
    request_timeout: float = 3600.0
    # Further tries of a call (not /shutdown) whose connection failed or broke, or that a
    # proxy answered 502/503/504; calls are safe to repeat (seeded rollouts, syncs by path).
    retries: int = 3
    # Wait before the first retry in seconds; doubled for each next one, at most max_backoff_s.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # Extra keyword arguments of vLLM-Omni's AsyncOmni (e.g. {enforce_eager: false}).
    engine_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class VllmRolloutConfig(RolloutConfig):
    engine: Engine = Engine.vllm
    options: VllmOptions = field(default_factory=VllmOptions)
