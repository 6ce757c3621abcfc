"""The options of `rollout=vllm` (`rollout.options`), in a module of their own: the engine's
client, its server and the driver's side all read them (see omni/rollout/vllm_engine.py)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from omni.config.rollout import Engine, RolloutConfig


class VllmBackend(str, Enum):
    vllm = "vllm"  # vLLM-Omni serves our pipeline
    native = "native"  # vLLM-Omni's own pipeline of the family, with our SDE scheduler (omni.rollout.native_support)
    local = "local"  # the same pipeline in the engine process without vLLM-Omni (tests, debugging)


class RequestsMode(str, Enum):
    per_group = "per_group"  # one vLLM-Omni request per prompt group, each image with its seed
    per_image = "per_image"  # one request per image (the engine's protocol before grouping)


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
    # What a vLLM-Omni request holds: a prompt group's images (fewer requests; vLLM-Omni's
    # edit pipelines, one request per forward, then batch a group) or one image.
    requests: RequestsMode = RequestsMode.per_group
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
    engine: Engine = Engine["vllm"]
    options: VllmOptions = field(default_factory=VllmOptions)
