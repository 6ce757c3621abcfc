"""The rollout engine process: vLLM-Omni running our pipeline, behind a small HTTP API
(FastAPI + uvicorn; the driver's client: `omni.rollout.engine_client`).

Runs in the engine's own environment (scripts/install_vllm_engine.sh); the training
driver starts it (rollout=vllm) or attaches to it (rollout.options.url=http://host:port):

    ENV/bin/python -m omni.rollout.vllm_server --model /ckpt/sd3.5-medium --port 8765

API (bodies are `omni.rollout.transport.pack` blobs, whose JSON each route types with a model of
`omni.rollout.engine_schemas`, shown at /docs; see `omni.rollout.vllm_engine`):
    GET  /health          {"ok", "has_base", "model", "backend"}
    POST /generate        prompts, seeds, options -> images, latents, log_probs, sigmas, embeddings
    POST /update_weights  a weight directory's path -> loaded into the pipeline's transformer
    POST /encode_prompts  prompts -> their conditioning;  POST /encode_images  images -> latents
    POST /shutdown

Backends: `vllm` (AsyncOmni with `FlowGRPOPipeline` and our worker extension), `native`
(AsyncOmni with vLLM-Omni's own pipeline of the family and our SDE scheduler,
`omni.rollout.vllm_native`; LoRA through vLLM-Omni's LoRA manager) and `local` (the same
pipeline class called in this process, through the same request/answer
mapping: runs without vLLM, for tests and debugging). Each sends one request per prompt
group (`--requests per_image`: one per image), each output with its own seed.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' parameter types at run
# time, and `fastapi` is imported in `build_app`, where string annotations would not resolve.
import argparse
import asyncio
import json
import logging
import os
import threading
import time
import traceback
import uuid
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

import torch

from omni.devices import DTYPES
from omni.models import get_family
from omni.models.base import Conditioning
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.transport import pack, unpack
from omni.rollout.vllm_pipeline import PIPELINE_CLASS, FlowGRPOPipeline
from omni.rollout.vllm_protocol import (
    batch_to_tensors,
    collate_results,
    emulate_request_output,
    prompt_groups,
    prompt_sources,
    request_inputs,
    result_from_output,
    with_sources,
)
from omni.serving import OneAtATime, import_server

logger = logging.getLogger("omni.vllm_server")


class LocalBackend:
    """Our pipeline in this process, fed the requests vLLM-Omni would get, in batches of
    `max_num_seqs`; its answers go through the formatter's mapping (`emulate_request_output`)."""

    def __init__(self, args):
        pipeline_args = {
            "family": args.family,
            "load_base": args.load_base,
            "vae_inversion_steps": args.vae_inversion_steps,
        }
        od_config = SimpleNamespace(model=args.model, dtype=DTYPES[args.dtype], custom_pipeline_args=pipeline_args)
        self.pipeline = FlowGRPOPipeline(od_config=od_config).to(args.device)
        self.conditioning = get_family(args.family).conditioning
        self.max_num_seqs = max_num_seqs(args)
        self.group_size = request_size(args)

    def has_base(self) -> bool:
        return self.pipeline.has_base

    def generate(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        requests = [request_inputs(p, s, options) for p, s in prompt_groups(prompts, seeds, self.group_size)]
        results = []
        for start in range(0, len(requests), self.max_num_seqs):
            chunk = requests[start : start + self.max_num_seqs]
            batch = SimpleNamespace(
                prompts=[prompt for prompt, _ in chunk],
                sampling_params_list=[SimpleNamespace(**sampling) for _, sampling in chunk],
            )
            results += [result_from_output(emulate_request_output(f)) for f in self.pipeline.forward_fields(batch)]
        return collate_results(prompts, results, options, self.conditioning)

    def sync_weights(self, path: str) -> Dict[str, Any]:
        return self.pipeline.sync_weights_from(path)

    def encode_prompts(self, prompts, guidance_scale, max_sequence_length) -> Conditioning:
        return self.pipeline.encode_prompts(prompts, guidance_scale, max_sequence_length)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.pipeline.encode_images(images)

    def close(self) -> None:
        self.pipeline = None


def pipeline_class(backend: str, family: str) -> str:
    """The pipeline vLLM-Omni runs: ours (backend vllm) or its own with our hooks (native)."""
    if backend != "native":
        return PIPELINE_CLASS
    from omni.rollout.native_support import native_families, native_pipeline_class

    if family not in native_families():
        raise ValueError(f"--backend native: no native pipeline for family {family}; supported: {native_families()}")
    return native_pipeline_class(family)


def request_size(args) -> int:
    """Images a request holds at most: a prompt group's (`--group-size`) with `--requests
    per_group`, else 1 (also for a native pipeline that does not repeat its conditioning
    per output: `native.groups_outputs`)."""
    if args.requests != "per_group":
        return 1
    if args.backend == "native":
        from omni.rollout.native_support import native_facts

        if not native_facts(args.family).groups_outputs:
            return 1
    return max(1, args.group_size)


def max_num_seqs(args) -> int:
    """Requests per forward, so that a forward samples at most `--max-num-seqs` images: that
    over the images a request holds (`request_size`), or 1 where vLLM-Omni's pipeline of the
    family samples one request at a time (no `supports_request_batch`, e.g. its
    FluxKontextPipeline: a prompt group's images in one forward is then what batches them)."""
    requests = max(1, args.max_num_seqs // request_size(args))
    if args.backend != "native":
        return requests
    from omni.rollout.vllm_native import native_pipeline

    if getattr(native_pipeline(args.family), "supports_request_batch", False):
        return requests
    logger.info("vLLM-Omni's pipeline of %s takes one request per forward: max_num_seqs 1", args.family)
    return 1


def engine_kwargs(args) -> Dict[str, Any]:
    """AsyncOmni's keyword arguments: our pipeline class and worker extension, and the
    settings the pipeline relies on; `--engine-args` adds to or overrides the rest."""
    from omni.rollout.vllm_worker import WORKER_EXTENSION_CLASS

    ours = dict(
        custom_pipeline_args={
            "pipeline_class": pipeline_class(args.backend, args.family),
            "family": args.family,
            "load_base": args.load_base,
            "vae_inversion_steps": args.vae_inversion_steps,
        },
        worker_extension_cls=WORKER_EXTENSION_CLASS,
        enforce_eager=True,  # PEFT adapters are injected after start-up: no captured graphs
        max_num_seqs=max_num_seqs(args),
        dtype=args.dtype,
        output_type="latent",  # the family's post-process then passes our payload through untouched
    )
    return {**ours, **json.loads(args.engine_args)}


class VllmOmniBackend:
    """AsyncOmni on its own event-loop thread; HTTP handlers wait on its coroutines."""

    def __init__(self, args):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="vllm-omni-loop", daemon=True).start()
        self.omni = self._wait(self._start(args))
        self.conditioning = get_family(args.family).conditioning
        self.group_size = request_size(args)

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _start(self, args):
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        return AsyncOmni(model=args.model, **engine_kwargs(args))

    def _rpc(self, method: str, *args):
        """Call a worker-extension method; the answer of the first worker of the (only) stage."""
        result = self._wait(self.omni.collective_rpc(method, args=args))
        while isinstance(result, list):  # per stage, then per worker
            result = result[0]
        if isinstance(result, dict) and result.get("supported") is False:  # how vLLM-Omni reports a failed RPC
            raise RuntimeError(f"vLLM-Omni's worker failed {method}: {result.get('error')}")
        return result

    def has_base(self) -> bool:
        return bool(self._rpc("omni_has_base"))

    def _request_extras(self) -> Dict[str, Any]:
        """Sampling-params fields every request gets (the native backend: its LoRA)."""
        return {}

    def _request(self, prompt: str, seeds: Sequence[int], options: SamplingOptions):
        """One request's (prompt, sampling-params fields): the prompt's images, one per seed."""
        return request_inputs(prompt, seeds, options)

    async def _generate_one(self, prompt, sampling: Dict[str, Any], request_id: str):
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        sampling = {**sampling, **self._request_extras()}
        last = None
        async for output in self.omni.generate(
            prompt=prompt, request_id=request_id, sampling_params_list=[OmniDiffusionSamplingParams(**sampling)]
        ):
            last = output
        return result_from_output(last)

    async def _generate(self, prompts, seeds, options) -> List[Dict[str, torch.Tensor]]:
        call = uuid.uuid4().hex[:8]
        requests = [self._request(p, s, options) for p, s in prompt_groups(prompts, seeds, self.group_size)]
        return await asyncio.gather(
            *(self._generate_one(prompt, sampling, f"omni-{call}-{i}") for i, (prompt, sampling) in enumerate(requests))
        )

    def generate(self, prompts, seeds, options) -> RolloutBatch:
        return collate_results(prompts, self._wait(self._generate(prompts, seeds, options)), options, self.conditioning)

    def sync_weights(self, path: str) -> Dict[str, Any]:
        return self._sync("omni_sync_weights", path)

    def _sync(self, method: str, path: str, *args) -> Dict[str, Any]:
        """A weight sync's RPC; a worker that failed it (vLLM-Omni logs its traceback and
        answers without our fields) is an error naming the method and the directory."""
        answer = self._rpc(method, *args, path)
        if not isinstance(answer, dict) or "has_base" not in answer:
            raise RuntimeError(
                f"vLLM-Omni's worker failed {method} on {path} (it answered {answer!r}); its traceback is in the "
                "engine log"
            )
        return answer

    def encode_prompts(self, prompts, guidance_scale, max_sequence_length) -> Conditioning:
        texts = [str(p) for p in prompts]  # the sources travel apart, as plain lists
        tensors = self._rpc("omni_encode_prompts", texts, guidance_scale, max_sequence_length, prompt_sources(prompts))
        return self.conditioning(**tensors)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self._rpc("omni_encode_images", images)

    def close(self) -> None:
        self.omni.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)


class NativeBackend(VllmOmniBackend):
    """vLLM-Omni's own pipeline of the family with our scheduler (`omni.rollout.vllm_native`).
    LoRA syncs load into vLLM-Omni's LoRA manager by path; every later request names the
    latest adapter, so one batch never mixes two policies. Requests carry the family's
    guidance as vLLM-Omni's pipeline takes it (`request_guidance`: Qwen-Image's negative
    prompt and `true_cfg_scale`)."""

    def __init__(self, args):
        super().__init__(args)
        self.family = args.family
        self.lora = None  # (name, id, path) of the adapter requests use

    def _request(self, prompt: str, seeds: Sequence[int], options: SamplingOptions):
        from omni.rollout.native_support import request_guidance

        text, sampling = request_inputs(prompt, seeds, options)
        prompt_fields, sampling_fields = request_guidance(self.family, options.guidance_scale)
        return {**text, **prompt_fields}, {**sampling, **sampling_fields}

    def _request_extras(self) -> Dict[str, Any]:
        from omni.rollout.vllm_worker import native_lora_request

        return {} if self.lora is None else {"lora_request": native_lora_request(*self.lora)}

    def sync_weights(self, path: str) -> Dict[str, Any]:
        from omni.rollout.transport import sync_kind

        if sync_kind(path) != "lora":
            return self._sync("omni_sync_weights", path)
        adapter = (os.path.basename(path), (self.lora[1] + 1) if self.lora else 1, path)
        answer = self._sync("omni_add_lora", path, *adapter[:2])
        self.lora = adapter
        return answer


ROUTES = ("generate", "update_weights", "encode_prompts", "encode_images")
BLOB = "application/octet-stream"


def handle(backend, route: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> bytes:
    """One API call -> the packed answer (`meta` checked against the route's model first)."""
    from omni.rollout.engine_schemas import REQUESTS

    if route not in REQUESTS:
        raise KeyError(f"unknown route /{route}")
    request = REQUESTS[route].model_validate(meta)
    if route == "generate":
        prompts = with_sources(request.prompts, request.sources)
        return pack(batch_to_tensors(backend.generate(prompts, request.seeds, request.options)))
    if route == "update_weights":
        return pack(meta=backend.sync_weights(request.path))
    if route == "encode_prompts":
        prompts = with_sources(request.prompts, request.sources)
        return pack(backend.encode_prompts(prompts, request.guidance_scale, request.max_sequence_length).tensors())
    if "images" not in tensors:
        raise ValueError("/encode_images: the body has no tensor 'images'")
    return pack({"latents": backend.encode_images(tensors["images"])})


def build_app(backend, info: Dict[str, Any], stop: threading.Event):
    """The engine's API over `backend` (FastAPI). Backend calls run one at a time, in the
    order they came, on one thread: the local backend's torch modules are not safe to share
    between threads, and for both backends a weight sync must never land in the middle of a
    rollout (one batch, two policies). /health reads `has_base` as the last call left it, so
    it answers at once even during an hour-long /generate."""
    fastapi, _ = import_server("the rollout engine's server")
    from pydantic import ValidationError
    from starlette.background import BackgroundTask

    from omni.rollout.engine_schemas import REQUESTS, EngineHealth, openapi_extra

    app = fastapi.FastAPI(title="omni-recipes rollout engine", description=__doc__)
    one_at_a_time = OneAtATime("backend")
    state = {"has_base": backend.has_base()}

    @app.get("/health", response_model=EngineHealth)
    async def health():
        return EngineHealth(ok=True, has_base=state["has_base"], **info)

    @app.post("/shutdown")
    async def shutdown():
        # answered first, then the process stops (main)
        return fastapi.Response(pack(meta={"ok": True}), media_type=BLOB, background=BackgroundTask(stop.set))

    def call(route: str, body: bytes) -> bytes:
        try:
            tensors, meta = unpack(body)
            return handle(backend, route, tensors, meta)
        finally:
            if route == "update_weights":
                state["has_base"] = backend.has_base()

    def add_route(route: str) -> None:
        async def endpoint(request: fastapi.Request):
            body = await request.body()
            try:
                return fastapi.Response(await one_at_a_time(call, route, body), media_type=BLOB)
            except ValidationError as error:  # the request's JSON does not fit its model: refused, named
                fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
                return fastapi.Response(
                    f"/{route}: the message's JSON does not fit {error.title} ({fields})",
                    status_code=422,
                    media_type="text/plain",
                )
            except Exception:  # the driver shows the engine's traceback
                logger.exception("/%s failed", route)
                return fastapi.Response(traceback.format_exc(), status_code=500, media_type="text/plain")

        endpoint.__doc__ = REQUESTS[route].__doc__
        app.add_api_route(f"/{route}", endpoint, methods=["POST"], name=route, openapi_extra=openapi_extra(route, BLOB))

    for route in ROUTES:
        add_route(route)
    return app


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="diffusers checkpoint directory")
    parser.add_argument("--family", default="sd3", help="the model family (model.family)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--no-load-base", dest="load_base", action="store_false", help="start with a dummy transformer")
    parser.add_argument(
        "--vae-inversion-steps",
        type=int,
        default=0,
        help="encode images by inverting the VAE's decoder (model.vae_inversion_steps)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="images per pipeline forward, at most")
    parser.add_argument(
        "--requests",
        default="per_group",
        choices=("per_group", "per_image"),
        help="a request per prompt group (a run of equal prompts, at most --group-size images) or per image",
    )
    parser.add_argument("--group-size", type=int, default=1, help="images a prompt group holds (algorithm.group_size)")
    parser.add_argument("--backend", default="vllm", choices=("vllm", "native", "local"))
    parser.add_argument("--device", default="cpu", help="local backend only (vLLM-Omni places its worker itself)")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra AsyncOmni keyword arguments")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the process that started us dies")
    return parser.parse_args(argv)


def stop_when_parent_dies(stop: threading.Event, poll_s: float = 2.0) -> None:
    """A driver killed without shutting us down must not leave the engine (and its GPU) behind."""
    parent = os.getppid()

    def watch():
        while not stop.wait(poll_s):
            if os.getppid() != parent:  # re-parented: the driver is gone
                logger.warning("the driver (pid %d) exited; stopping", parent)
                stop.set()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _, uvicorn = import_server("the rollout engine's server")
    backend = {"vllm": VllmOmniBackend, "native": NativeBackend, "local": LocalBackend}[args.backend](args)
    stop = threading.Event()
    if args.exit_with_parent:
        stop_when_parent_dies(stop)
    info = {"model": args.model, "family": args.family, "backend": args.backend}
    config = uvicorn.Config(
        build_app(backend, info, stop), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise SystemExit(f"the server did not start on {args.host}:{args.port}")
            time.sleep(0.05)
        logger.info("rollout engine (%s) listening on http://%s:%d", args.backend, args.host, args.port)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        backend.close()


if __name__ == "__main__":
    main()
