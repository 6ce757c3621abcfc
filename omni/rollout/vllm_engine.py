"""`rollout=vllm`: the driver's side of the vLLM-Omni rollout engine.

vLLM-Omni pins diffusers/transformers versions that conflict with verl's, so the engine
runs in its own environment and process (`omni.rollout.vllm_server`). `VllmEngine` either
starts it with that environment's python (and stops it with the run) or attaches to one
already running (`rollout.options.url`). Calls go over HTTP as safetensors blobs; weights
from `collect_lora_params` go through a directory both sides read (`omni.rollout.transport`):
the base weights once when the engine started without them, then LoRA adapters.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from omegaconf import OmegaConf

import omni
from omni.config.errors import ConfigError, require
from omni.config.model import LoraConfig
from omni.models.base import Conditioning, ModelFamily
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.engine_client import EngineClient, EngineUnreachable, retry_policy
from omni.rollout.transport import pack, write_base_weights, write_lora_adapter
from omni.rollout.vllm_options import RequestsMode, VllmBackend, VllmOptions, VllmRolloutConfig
from omni.rollout.vllm_protocol import batch_from_tensors, prompt_sources

logger = logging.getLogger(__name__)
DEFAULT_ENV = "~/.cache/omni-recipes/vllm-engine"
INSTALL_HINT = (
    "rollout=vllm runs vLLM-Omni in its own environment (its pins conflict with verl's, so there is "
    "no `pip install omni-recipes[vllm]`): create it with `bash scripts/install_vllm_engine.sh` "
    f"(into {DEFAULT_ENV}), or point rollout.options.python=/path/to/env/bin/python at an env with "
    "vllm-omni, or attach to a running engine with rollout.options.url=http://host:port "
    "(started by `ENV/bin/python -m omni.rollout.vllm_server --model ...`)"
)


Options = VllmRolloutConfig  # stored as schema/rollout/vllm (omni/conf/rollout/vllm.yaml)


def check_config(cfg, family: ModelFamily) -> None:
    """rollout=vllm's rules, at validation: a family it serves (backend=native checks its own),
    an engine to start or attach to."""
    rollout = cfg.rollout
    if rollout.options.backend == VllmBackend.native:  # the family's own check
        check_native_transformer(cfg.model, family)
    else:
        require(family.vllm_served, not_served(family, rollout.options.backend))
    check_vllm_rollout(rollout, family.name)


def not_served(family: ModelFamily, backend: VllmBackend) -> str:
    """Why `backend` (vllm or local: our pipeline inside the engine) cannot serve `family`,
    naming the native backend where vLLM-Omni's own pipeline of the family can."""
    from omni.rollout.native_support import family_problem

    native = (
        "" if family_problem(family.name) else "rollout.options.backend=native (vLLM-Omni's own pipeline of it) or "
    )
    return (
        f"rollout=vllm: model.family={family.name} is not yet served by the vLLM-Omni engine with "
        f"rollout.options.backend={backend.value}; use {native}rollout=diffusers"
    )


def check_native_transformer(model, family: ModelFamily) -> None:
    """backend=native: vLLM-Omni's transformer of the family computes the trained one's
    velocity for this transformer config (else its rollouts are not the policy's). A family
    the backend does not serve is left to `check_vllm_rollout`, which names that first."""
    from omni.rollout.native_support import family_problem
    from omni.validation import transformer_config

    if family_problem(family.name):
        return
    problem = family.native.transformer_problem(transformer_config(model, family))
    alternative = "rollout.options.backend=vllm" if family.vllm_served else "rollout=diffusers"
    require(
        problem is None, f"rollout.options.backend=native: model.family={family.name}: {problem}; use {alternative}"
    )


def check_vllm_rollout(rollout, family: str) -> None:
    """rollout=vllm: an engine to start or attach to (for backend=native, one whose vLLM-Omni
    has the hooks the family's native pipeline uses)."""
    problem = engine_unavailable(rollout.options, family)
    require(problem is None, f"rollout=vllm: {problem}")
    if rollout.options.url:
        probe_engine(rollout.options)


# Seconds an engine the run attaches to (rollout.options.url) has to answer /health at validation.
ENGINE_PROBE_TIMEOUT_S = 5.0


def probe_engine(options) -> None:
    """The engine at rollout.options.url answers /health, within a short timeout and without
    retries: a wrong or dead URL is named here, not after the transformer has loaded."""
    client = EngineClient(options.url, options)
    try:
        client.health(retry=False, timeout=ENGINE_PROBE_TIMEOUT_S)
    except Exception as error:  # refused, timed out, dropped, or an answer that is not the engine's
        raise ConfigError(
            f"rollout.options.url={options.url}: no rollout engine answered GET /health within "
            f"{ENGINE_PROBE_TIMEOUT_S:g}s ({type(error).__name__}: {str(error)[:200]}); start it "
            "(ENV/bin/python -m omni.rollout.vllm_server --model ... --port ...) or leave rollout.options.url "
            "unset for the run to start one"
        ) from None
    finally:
        client.close()


def build(cfg, family: ModelFamily, model_path: str, device: torch.device, dtype: torch.dtype) -> "VllmEngine":
    """`rollout.engine=vllm`."""
    rollout = cfg.rollout
    return VllmEngine.start(
        family,
        vllm_options(rollout.options),
        model_path,
        device,
        dtype,
        rollout.micro_batch_size,
        rollout.load_base,
        cfg.output_dir,
        cfg.model.vae_inversion_steps,
        getattr(cfg.algorithm, "group_size", 1),
    )


def vllm_options(options) -> VllmOptions:
    """`rollout.options` (typed, or the plain dict of a resolved config) as VllmOptions."""
    if isinstance(options, VllmOptions):
        return options
    if OmegaConf.is_config(options):
        options = OmegaConf.to_container(options, resolve=True)
    options = dict(options or {})
    known = {f.name for f in dataclasses.fields(VllmOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"rollout.options: unknown {unknown} for rollout=vllm; known: {sorted(known)}")
    return VllmOptions(**options)


@functools.lru_cache(maxsize=None)
def _has_vllm_omni(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm_omni') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def engine_python(options: VllmOptions) -> Optional[str]:
    """The engine env's python, or None when none is found. The local backend needs only
    this package's dependencies, so it defaults to this python."""
    if options.python:
        return options.python
    if options.backend == "local":
        return sys.executable
    env_python = os.environ.get("OMNI_VLLM_PYTHON")
    if env_python:
        return env_python
    default = Path(DEFAULT_ENV).expanduser() / "bin" / "python"
    if default.exists():
        return str(default)
    return sys.executable if _has_vllm_omni(sys.executable) else None


def engine_unavailable(options: VllmOptions, family: Optional[str] = None) -> Optional[str]:
    """Why the engine cannot start or be called (None when it can): checked before any model
    loads. `family` (model.family) is checked against the native backend's families and,
    in the engine env, the installed vLLM-Omni's hooks."""
    from omni.rollout.native_support import family_problem, native_problem

    if options.backend not in ("vllm", "native", "local"):
        return f"rollout.options.backend={options.backend}: expected vllm, native or local"
    if options.backend == "native" and family is not None and family_problem(family):
        return family_problem(family)
    problem = retry_policy(options).problem()
    if problem:
        return problem
    if options.url:
        return (
            None
            if options.url.startswith(("http://", "https://"))
            else f"rollout.options.url={options.url}: expected http://host:port"
        )
    python = engine_python(options)
    if python is None:
        return f"no vLLM-Omni engine environment found. {INSTALL_HINT}"
    if not Path(python).exists():
        return f"rollout.options.python={python}: no such file. {INSTALL_HINT}"
    if options.backend != "local" and not _has_vllm_omni(python):
        return f"{python} has no vllm_omni installed. {INSTALL_HINT}"
    if options.backend == "native" and family is not None:
        return native_problem(python, family)
    return None


def _engine_env(device: torch.device) -> Dict[str, str]:
    """The driver's environment, with our package importable and the worker's device: its
    GPU visible, or on a CPU our vLLM-Omni CPU platform (vLLM-Omni has none of its own)."""
    env = dict(os.environ)
    repo = str(Path(omni.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    if device.type == "cpu":
        env.setdefault("OMNI_VLLM_CPU", "1")
    if device.type == "cuda":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        index = device.index or 0
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return env


class VllmEngine:
    """The rollout engine interface (`omni.rollout.base.RolloutEngine`) over HTTP."""

    shares_actor = False  # a process of its own: it always holds its own copy

    def __init__(
        self,
        options: VllmOptions,
        family: ModelFamily,
        url: str,
        shared_dir: Path,
        process: Optional[subprocess.Popen] = None,
    ):
        self.options, self.url, self.process = options, url, process
        self.client = EngineClient(url, options)
        self.conditioning = family.conditioning
        self.shared_dir = Path(shared_dir)
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        self._versions = 0
        self._last_sync: Optional[Path] = None
        self.lora_modules: Optional[list] = None  # as the engine's last LoRA sync answered
        self.has_base = bool(self.client.health()["has_base"])

    def _post(self, route: str, body: bytes):
        """`client.post`; when the engine process we started has died, the error says so
        (its exit code or signal, and its log) rather than only that nothing answered."""
        try:
            return self.client.post(route, body)
        except EngineUnreachable as error:
            if self.process is None:
                raise
            try:  # a killed process drops its connections a moment before it can be reaped
                code = self.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                raise error from None
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise EngineUnreachable(
                f"the rollout engine process (pid {self.process.pid}) is gone: {how}; its log: "
                f"{self.shared_dir / 'engine.log'} ({error})"
            ) from None

    # ----------------------------------------------------------------- start / attach
    @classmethod
    def start(
        cls,
        family: ModelFamily,
        options: VllmOptions,
        model_path: str,
        device: torch.device,
        dtype: torch.dtype,
        micro_batch_size: int,
        load_base: bool,
        run_dir: Path,
        vae_inversion_steps: int = 0,
        group_size: int = 1,
    ) -> "VllmEngine":
        """Attach to `options.url`, or start an engine process for `model_path`, which sends
        vLLM-Omni a request per prompt group of up to `group_size` images
        (`options.requests`), at most `micro_batch_size` images a forward."""
        shared_dir = Path(options.shared_dir or Path(run_dir) / "vllm_engine") / f"worker-{os.getpid()}"
        if options.url:
            served = EngineClient(options.url, options).health()["model"]
            if Path(served).name != Path(model_path).name:
                logger.warning("the engine at %s serves %s, the run trains %s", options.url, served, model_path)
            return cls(options, family, options.url, shared_dir)
        problem = engine_unavailable(options, family.name)
        if problem:
            raise RuntimeError(problem)
        url, process = _launch(
            options,
            family.name,
            model_path,
            device,
            dtype,
            micro_batch_size,
            load_base,
            shared_dir,
            vae_inversion_steps,
            group_size,
        )
        return cls(options, family, url, shared_dir, process)

    # ----------------------------------------------------------------- rollout
    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if options.tree:
            raise ValueError("the vLLM-Omni engine samples no trees (TreeGRPO): use rollout=diffusers")
        meta = {
            "prompts": [str(p) for p in prompts],
            "sources": prompt_sources(prompts),
            "seeds": [int(s) for s in seeds],
            "options": dataclasses.asdict(options),
        }
        tensors, _ = self._post("generate", pack(meta=meta))
        return batch_from_tensors(prompts, tensors, options, self.conditioning)

    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Conditioning:
        meta = {
            "prompts": [str(p) for p in prompts],
            "sources": prompt_sources(prompts),
            "guidance_scale": guidance_scale,
            "max_sequence_length": max_sequence_length,
        }
        tensors, _ = self._post("encode_prompts", pack(meta=meta))
        return self.conditioning.from_tensors(tensors)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        tensors, _ = self._post("encode_images", pack({"images": images}))
        return tensors["latents"]

    # ----------------------------------------------------------------- weights
    def update_weights(
        self, named_tensors: Dict[str, torch.Tensor], base_sync_done: bool, lora: Optional[LoraConfig]
    ) -> None:
        """Base weights (base_sync_done False) or the LoRA of `lora.adapter_name`, written
        to the shared directory and loaded by the engine before this returns."""
        if base_sync_done and not self.has_base:
            raise RuntimeError("the engine got LoRA weights before any base weights; sync the base first")
        self._versions += 1
        name = f"{'lora' if base_sync_done else 'base'}-{self._versions:06d}"
        if base_sync_done:
            path = write_lora_adapter(self.shared_dir, name, named_tensors, lora)
        else:
            path = write_base_weights(self.shared_dir, name, named_tensors)
        # a retried sync loads the same directory again: it is removed only once acknowledged
        _, answer = self._post("update_weights", pack(meta={"path": str(path.resolve())}))
        self.has_base = bool(answer["has_base"])
        if base_sync_done:  # the native backend's LoRA manager does not say: None
            self.lora_modules = answer.get("lora_modules")
        if self._last_sync is not None:
            shutil.rmtree(self._last_sync, ignore_errors=True)  # loaded: the engine no longer reads it
        self._last_sync = path

    def shutdown(self) -> None:
        """Stop the engine if we started it (an attached one keeps running)."""
        if self.process is not None:
            try:
                self.client.post("shutdown", pack(), retry=False, timeout=30)  # not repeated: the engine may be gone
            except OSError:
                pass
            _stop_process(self.process)
            self.process = None
        self.client.close()
        if self._last_sync is not None:
            shutil.rmtree(self._last_sync, ignore_errors=True)
            self._last_sync = None


def _launch(
    options,
    family: str,
    model_path,
    device,
    dtype,
    micro_batch_size,
    load_base,
    shared_dir: Path,
    vae_inversion_steps: int = 0,
    group_size: int = 1,
):
    """Start `omni.rollout.vllm_server` with the engine env's python; wait until it answers."""
    from omni.distributed import free_port

    port = free_port()
    command = [
        engine_python(options),
        "-m",
        "omni.rollout.vllm_server",
        "--model",
        str(model_path),
        "--family",
        family,
        "--port",
        str(port),
    ]
    command += [
        "--dtype",
        str(dtype).removeprefix("torch."),
        "--max-num-seqs",
        str(micro_batch_size),
        "--backend",
        options.backend,
    ]
    command += ["--device", device.type, "--engine-args", json.dumps(dict(options.engine_args)), "--exit-with-parent"]
    command += [] if load_base else ["--no-load-base"]
    command += ["--vae-inversion-steps", str(vae_inversion_steps)]
    command += ["--requests", RequestsMode(options.requests).value, "--group-size", str(group_size)]
    shared_dir.mkdir(parents=True, exist_ok=True)
    log = shared_dir / "engine.log"
    with open(log, "ab") as out:
        # its own session, so that stopping it stops vLLM-Omni's worker processes too
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=_engine_env(device), start_new_session=True
        )
    atexit.register(_stop_process, process, 0.0)
    url = f"http://127.0.0.1:{port}"
    _wait_until_healthy(url, process, log, options)
    return url, process


def _wait_until_healthy(url: str, process: subprocess.Popen, log: Path, options: VllmOptions) -> None:
    timeout = options.startup_timeout
    deadline = time.monotonic() + timeout
    client = EngineClient(url, options)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(
                f"the vLLM-Omni engine exited with code {process.returncode} while starting; {log}:\n{tail}"
            )
        try:
            client.health(retry=False, timeout=5)  # this loop is the retry
            client.close()
            return
        except OSError:
            time.sleep(1.0)
    client.close()
    _stop_process(process)
    raise TimeoutError(
        f"the vLLM-Omni engine did not answer {url}/health within {timeout:.0f} s "
        f"(rollout.options.startup_timeout); see {log}"
    )


def _stop_process(process: subprocess.Popen, grace: float = 30.0) -> None:
    """Give the engine `grace` seconds to exit after /shutdown, then SIGTERM, then SIGKILL
    its process group (the server and vLLM-Omni's workers)."""
    for sig, wait in ((None, grace), (signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        if process.poll() is not None:
            return
        if sig is not None:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
