"""rollout=vllm from the driver's side: the clear error when no engine is installed, and the
whole path (start the engine process, HTTP, weight directories, shutdown) on the CPU with
the engine's `local` backend, which runs our pipeline without vLLM-Omni."""

import subprocess
import sys
import time

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.models.sd3 import FAMILY, build_tiny_transformer
from omni.rollout.engine_client import EngineClient
from omni.rollout.vllm_engine import VllmEngine, engine_unavailable, vllm_options
from omni.rollout.vllm_options import VllmOptions
from omni.rollout.vllm_protocol import batch_to_tensors
from omni.validation import ConfigError, validate
from omni.weights import lora_module_names, plain_base_names
from tests.conftest import compose_config
from tests.rollout.conftest import LORA, options, random_lora
from tests.servers import breaking_proxy

PROMPTS = ["a red cat", "a blue dog", "a red cat", "a green tree"]
SEEDS = [1, 2, 3, 4]


@pytest.fixture
def no_engine_env(monkeypatch, tmp_path):
    """A machine without the engine env: no $OMNI_VLLM_PYTHON, an empty home."""
    monkeypatch.delenv("OMNI_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_missing_engine_fails_at_validation_saying_what_to_install(no_engine_env, tiny_cache, tmp_path):
    cfg = compose_config(["rollout=vllm", f"model.cache_dir={tiny_cache}"], tmp_path)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    for hint in ("rollout=vllm", "scripts/install_vllm_engine.sh", "rollout.options.python", "rollout.options.url"):
        assert hint in message


def test_a_local_backend_validates_without_the_engine_env(no_engine_env, tiny_cache, tmp_path):
    """(Attaching by rollout.options.url needs no engine env either, but an engine that answers:
    tests/config/test_engine_probe.py.)"""
    cfg = validate(
        compose_config(["rollout=vllm", "rollout.options.backend=local", f"model.cache_dir={tiny_cache}"], tmp_path)
    )
    assert cfg.rollout.engine == "vllm"


def test_bad_options_are_named(no_engine_env):
    assert "rollout.options.python=/nowhere/python" in engine_unavailable(VllmOptions(python="/nowhere/python"))
    assert "rollout.options.url=engine:8765" in engine_unavailable(VllmOptions(url="engine:8765"))
    assert "rollout.options.backend=tpu" in engine_unavailable(VllmOptions(backend="tpu"))
    assert "rollout.options.retries=-1 must be >= 0" in engine_unavailable(VllmOptions(backend="local", retries=-1))
    assert "rollout.options.request_timeout=0 must be positive" in engine_unavailable(
        VllmOptions(url="http://x:1", request_timeout=0)
    )
    with pytest.raises(ValueError, match="unknown \\['ur'\\]"):
        vllm_options({"ur": "http://x"})


def test_bad_retry_options_fail_validation_naming_the_key(tiny_cache, tmp_path):
    cfg = compose_config(
        [
            "rollout=vllm",
            "rollout.options.backend=local",
            "rollout.options.backoff_s=-1",
            f"model.cache_dir={tiny_cache}",
        ],
        tmp_path,
    )
    with pytest.raises(ConfigError, match="rollout.options.backoff_s=-1.0 must be >= 0"):
        validate(cfg)


def test_native_backend_refuses_a_family_it_does_not_extend(tiny_cache, tmp_path):
    """Refused from the family alone (Wan2.2 A14B's two experts), before any engine env is looked at."""
    cfg = compose_config(
        ["rollout=vllm", "model=wan22_tiny", "rollout.options.backend=native", f"model.cache_dir={tiny_cache}"],
        tmp_path,
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    for hint in (
        "rollout.options.backend=native",
        f"model.family={cfg.model.family}",
        "vLLM-Omni has a Wan22Pipeline but omni-recipes does not extend it yet",
        "supported: model.family in ['flux', 'flux_kontext', 'qwen_image', 'qwen_image_edit_plus', 'sd3', 'wan']",
        "vLLM-Omni 0.30.x",
    ):
        assert hint in message


def test_native_backend_refuses_a_transformer_vllm_omni_computes_otherwise(tiny_cache, tmp_path):
    """The tiny Wan's heads of 16 channels, whose rotary split vLLM-Omni applies otherwise
    than it builds: refused from the transformer's config, before any engine env is looked at."""
    cfg = compose_config(
        ["rollout=vllm", "model=wan_tiny", "rollout.options.backend=native", f"model.cache_dir={tiny_cache}"], tmp_path
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert "rollout.options.backend=native: model.family=wan: attention_head_dim=16" in message
    assert "use rollout=diffusers" in message and "install_vllm_engine" not in message


def test_native_backend_needs_vllm_omni_in_the_engine_env(no_engine_env):
    problem = engine_unavailable(VllmOptions(backend="native", python=sys.executable), "sd3")
    assert "has no vllm_omni installed" in problem


@pytest.mark.parametrize("model", ["flux_tiny", "qwen_image_tiny", "flux_kontext_tiny", "qwen_image_edit_plus_tiny"])
def test_native_backend_takes_flux_and_qwen_image_on_to_the_engine_env_check(
    model, no_engine_env, tiny_cache, tmp_path
):
    """FLUX, Qwen-Image and their edit families have native pipelines (though the `vllm`
    backend serves neither FLUX nor the edit families): what stops them here is the missing
    engine env, not their family."""
    data = ["data=recolor"] if model in ("flux_kontext_tiny", "qwen_image_edit_plus_tiny") else []
    cfg = compose_config(
        ["rollout=vllm", f"model={model}", "rollout.options.backend=native", f"model.cache_dir={tiny_cache}", *data],
        tmp_path,
    )
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "scripts/install_vllm_engine.sh" in str(info.value) and "model.family" not in str(info.value)


def test_an_env_without_vllm_omni_is_refused(no_engine_env):
    assert "has no vllm_omni installed" in engine_unavailable(VllmOptions(python=sys.executable))


@pytest.fixture(scope="module")
def started_engine(tiny_sd3_dir, tmp_path_factory):
    """An engine process started without base weights, as rollout.load_base=false does."""
    run_dir = tmp_path_factory.mktemp("run")
    engine = VllmEngine.start(
        FAMILY,
        VllmOptions(backend="local", startup_timeout=300),
        tiny_sd3_dir,
        torch.device("cpu"),
        torch.float32,
        2,
        False,
        run_dir,
    )
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_engine_process_matches_diffusers_engine_across_syncs(started_engine, diffusers_engine):
    engine = started_engine
    assert not engine.has_base
    with pytest.raises(RuntimeError, match="before any base weights"):
        engine.update_weights(random_lora(diffusers_engine.transformer), True, LORA)
    base = {k: v.detach() for k, v in plain_base_names(diffusers_engine.transformer).items()}
    engine.update_weights(base, base_sync_done=False, lora=None)
    assert engine.has_base and EngineClient(engine.url, VllmOptions()).health()["has_base"]
    for opts in (options(), options(guidance_scale=3.0, sde_steps=(1, 3))):
        got, expected = engine.generate(PROMPTS, SEEDS, opts), diffusers_engine.generate(PROMPTS, SEEDS, opts)
        assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
        assert (got.latents - expected.latents).abs().max() <= 1e-5
        assert got.cond.embeds.shape == expected.cond.embeds.shape
    before = engine.generate(PROMPTS, SEEDS, options())
    for seed in (1, 2):  # the first LoRA sync adds the adapter, later ones overwrite it
        lora = random_lora(diffusers_engine.transformer, seed=seed)
        engine.update_weights(lora, base_sync_done=True, lora=LORA)
        diffusers_engine.update_weights(lora, base_sync_done=True, lora=LORA)
        got, expected = engine.generate(PROMPTS, SEEDS, options()), diffusers_engine.generate(PROMPTS, SEEDS, options())
        assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
    assert (got.images - before.images).abs().max() > 1e-3
    assert len(list(engine.shared_dir.glob("lora-*"))) == 1  # loaded syncs are removed
    latents = engine.encode_images(expected.images)
    assert torch.allclose(latents, diffusers_engine.encode_images(expected.images), atol=1e-5)
    cond = engine.encode_prompts(["a red cat"], 3.0, 16)
    assert torch.allclose(
        cond.neg_embeds, diffusers_engine.encode_prompts(["a red cat"], 3.0, 16).neg_embeds, atol=1e-6
    )


@pytest.mark.slow
def test_attached_engine_keeps_running_after_the_run(started_engine):
    attached = VllmEngine.start(
        FAMILY,
        VllmOptions(url=started_engine.url),
        "unused",
        torch.device("cpu"),
        torch.float32,
        2,
        True,
        started_engine.shared_dir,
    )
    attached.shutdown()
    assert EngineClient(started_engine.url, VllmOptions()).health()["ok"]


@pytest.mark.slow
def test_a_rollout_whose_connection_breaks_is_repeated_with_the_same_result(started_engine):
    """The first /generate through the proxy reaches the engine, which samples; its answer is
    cut halfway and the connection reset. The driver asks again and gets, bit for bit, what
    an undisturbed call gets."""
    expected = batch_to_tensors(started_engine.generate(PROMPTS, SEEDS, options()))
    with breaking_proxy(started_engine.url, b"POST /generate ") as (url, seen):
        attached = VllmEngine.start(
            FAMILY,
            VllmOptions(url=url, backoff_s=0.05),
            "unused",
            torch.device("cpu"),
            torch.float32,
            2,
            True,
            started_engine.shared_dir,
        )
        got = batch_to_tensors(attached.generate(PROMPTS, SEEDS, options()))
        attached.shutdown()
    assert len(seen) == 2  # broken once, then answered
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_engine_error_reaches_the_driver(started_engine):
    with pytest.raises(RuntimeError, match="has shape"):
        started_engine.update_weights(
            {k: torch.zeros(1) for k in plain_base_names(build_tiny_transformer())}, False, None
        )


def test_docs_describe_each_message_and_a_bad_one_is_refused_naming_the_field(started_engine):
    """The engine's JSON per route is a pydantic model: /openapi.json (what /docs shows) has
    each, and a message without a field is refused (422, the engine's own error) naming it."""
    import httpx

    from omni.rollout.engine_client import EngineError
    from omni.rollout.transport import pack

    spec = httpx.get(f"{started_engine.url}/openapi.json").json()
    generate = spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/octet-stream"]
    assert set(generate["x-omni-json-metadata"]["properties"]) == {"prompts", "sources", "seeds", "options"}
    sync = spec["paths"]["/update_weights"]["post"]["responses"]["200"]["content"]["application/octet-stream"]
    assert "has_base" in sync["x-omni-json-metadata"]["properties"]
    assert {"has_base", "model", "family", "backend"} <= set(
        spec["components"]["schemas"]["EngineHealth"]["properties"]
    )
    with pytest.raises(
        EngineError,
        match=r"HTTP 422: /generate: the message's JSON does not fit GenerateMeta \(seeds: Field required; "
        r"options.num_steps: Field",
    ):
        started_engine.client.post("generate", pack(meta={"prompts": ["a red cat"], "options": {}}))


@pytest.mark.slow
def test_shutdown_stops_the_engine_process(tiny_sd3_dir, tmp_path):
    engine = VllmEngine.start(
        FAMILY,
        VllmOptions(backend="local", startup_timeout=300),
        tiny_sd3_dir,
        torch.device("cpu"),
        torch.float32,
        2,
        True,
        tmp_path,
    )
    process = engine.process
    assert engine.has_base and process.poll() is None
    engine.shutdown()
    assert process.poll() == 0
    assert "listening on" in (tmp_path / "vllm_engine").rglob("engine.log").__next__().read_text()


@pytest.mark.slow
def test_engine_that_dies_at_start_shows_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code") as info:
        VllmEngine.start(
            FAMILY,
            VllmOptions(backend="local", startup_timeout=120),
            tmp_path / "no-model",
            torch.device("cpu"),
            torch.float32,
            2,
            True,
            tmp_path,
        )
    assert "no-model" in str(info.value)


@pytest.mark.parametrize(
    "overrides, syncs_at_setup, sync",
    [
        (["rollout.load_base=false"], ["base", "lora"], "lora"),
        (["rollout.load_base=true", "rollout.layered_summon=true"], ["lora"], "lora"),
        # slow lane: the worker's full sync is the in-process engine's (tests/workers), the
        # base's transport the case above; this joins them through the engine process
        pytest.param(["model.lora=null"], [], "base", marks=pytest.mark.slow),
    ],
    ids=["base_from_sync", "layered_summon", "full_finetuning"],
)
def test_worker_syncs_into_the_engine_process_and_rescores_exactly(
    overrides, syncs_at_setup, sync, tiny_cache, tmp_path, monkeypatch
):
    """The worker's contract with a vLLM engine: the base first only when the engine started
    without it, LoRA after (with full fine-tuning: the whole transformer at every sync, none
    at set-up when the engine loaded it); the actor re-scores the engine's trajectories exactly."""
    from omni.rollout import vllm_engine
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    written = []
    for name in ("write_base_weights", "write_lora_adapter"):
        real = getattr(vllm_engine, name)
        monkeypatch.setattr(
            vllm_engine, name, lambda *a, _real=real, _kind=name.split("_")[1]: written.append(_kind) or _real(*a)
        )
    cfg = validate(
        compose_config(
            ["rollout=vllm", "rollout.options.backend=local", *overrides, f"model.cache_dir={tiny_cache}"], tmp_path
        )
    )
    worker = ActorRolloutWorker(cfg, model_path(cfg.model))
    worker.setup()
    try:
        assert written == syncs_at_setup and worker.engine.has_base
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in worker.trainable:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        synced = worker.sync_weights()
        assert written[-1] == sync
        # the parity gate checked this sync (the second): the engine named the modules its adapter bound
        assert synced["sync/parity_max_log_prob_diff"] <= 1e-5
        if cfg.model.lora is not None:
            assert worker.engine.lora_modules == lora_module_names(worker.lora_state_dict())
            assert synced["sync/parity_missing_modules"] == 0
        steps = cfg.rollout.num_steps
        opts = options(
            num_steps=steps,
            resolution=cfg.rollout.resolution,
            guidance_scale=cfg.rollout.guidance_scale,
            sde_steps=(0, steps),
        )
        batch = worker.generate(PROMPTS, SEEDS, opts)
        samples, rows = torch.arange(len(batch)).repeat_interleave(steps), torch.arange(steps).repeat(len(batch))
        with torch.no_grad():
            actor, _ = flow_grpo.score_transitions(worker, batch, samples, rows, with_reference=False)
        assert (actor - batch.log_probs[samples, rows]).abs().max() <= 1e-5
    finally:
        worker.shutdown()
    assert worker.engine.process is None


@pytest.mark.slow
def test_engine_stops_when_its_driver_dies(tiny_sd3_dir, tmp_path):
    """A driver killed without shutdown (e.g. a lost Ray worker) must not leave the engine behind."""
    from omni.distributed import free_port

    port = free_port()
    server = [sys.executable, "-m", "omni.rollout.vllm_server", "--backend", "local", "--model", str(tiny_sd3_dir)]
    server += ["--port", str(port), "--dtype", "float32", "--exit-with-parent"]
    driver = (
        f"import subprocess, sys, time; p = subprocess.Popen({server!r}); print(p.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    engine_pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            EngineClient(f"http://127.0.0.1:{port}", VllmOptions()).health(retry=False, timeout=5)
            break
        except OSError:
            time.sleep(0.5)
    parent.kill()
    parent.wait()
    assert wait_for_exit(engine_pid, timeout=60)


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Whether `pid` (not our child) ends within `timeout`; a zombie awaiting its reaper counts."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.5)
    psutil.Process(pid).kill()
    return False


def test_killed_engine_is_named_with_the_step_and_the_last_checkpoint(tiny_cache, tmp_path):
    """The engine process (local backend) is killed once the first checkpoint is on disk: the
    run stops naming the dead process, the training step and the checkpoint to resume from."""
    import os
    import re
    import signal
    import threading

    import psutil

    from omni.rollout.engine_client import EngineUnreachable
    from omni.trainer import run

    run_dir = tmp_path / "run"
    overrides = [
        "rollout=vllm",
        "rollout.options.backend=local",
        "rollout.options.retries=0",
        "trainer.steps=4",
        "trainer.save_every=1",
        "trainer.batch_size=4",
        "algorithm.group_size=2",
        "eval.images_per_prompt=1",
        "trainer.progress_bar=false",
        f"model.cache_dir={tiny_cache}",
    ]
    killed = []

    def engine_processes():
        return {
            p.pid
            for p in psutil.Process().children(recursive=True)
            if "omni.rollout.vllm_server" in " ".join(p.cmdline())
        }

    others = engine_processes()  # engines of this module's other tests (their fixtures), left alone

    def kill_after_first_checkpoint():
        while not (run_dir / "checkpoints" / "step_000001").is_dir():
            if time.sleep(0.1) or len(killed):
                return
        engines = [psutil.Process(pid) for pid in engine_processes() - others]
        assert len(engines) == 1
        os.kill(engines[0].pid, signal.SIGKILL)
        killed.append(engines[0].pid)

    threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
    with pytest.raises(EngineUnreachable) as raised:
        run(compose_config(overrides, run_dir))
    killed.append(None)  # stops the watcher if the run ended first
    message = str(raised.value)
    assert f"the rollout engine process (pid {killed[0]}) is gone: killed by signal 9; its log: " in message, message
    step = re.search(r"during training step (\d+)\. Training stopped: ", message)
    assert step, message
    last = run_dir / "checkpoints" / f"step_{int(step.group(1)) - 1:06d}"
    assert f"the last checkpoint, {last}, is intact; continue with trainer.resume=auto" in message, message
