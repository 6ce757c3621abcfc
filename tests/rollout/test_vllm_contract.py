"""Our request/answer mapping against vLLM-Omni's real classes (skipped without vllm_omni,
which lives in the engine env; run there with
`ENV/bin/python -m pytest tests/rollout/test_vllm_contract.py`)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "vllm_omni", reason="vLLM-Omni is not installed here (it lives in the engine env: scripts/install_vllm_engine.sh)"
)

from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.output_formatter import format_diffusion_outputs, normalize_diffusion_postprocess_output  # noqa: E402
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402

from omni.rollout.vllm_pipeline import FlowGRPOPipeline  # noqa: E402
from omni.rollout.vllm_protocol import (  # noqa: E402
    emulate_request_output,
    options_from_sampling_params,
    request_inputs,
    result_from_output,
)
from omni.rollout.vllm_server import engine_kwargs, parse_args  # noqa: E402
from tests.rollout.conftest import od_config, options  # noqa: E402

OPTIONS = options(guidance_scale=3.0, sde_steps=(1, 3))


def real_requests(prompts, seeds, opts):
    requests = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        prompt, sampling = request_inputs(prompt, seed, opts)
        requests.append(
            OmniDiffusionRequest(
                prompt=prompt, sampling_params=OmniDiffusionSamplingParams(**sampling), request_id=f"r{i}"
            )
        )
    return requests


def test_request_round_trips_through_real_sampling_params():
    (request,) = real_requests(["a red cat"], [42], OPTIONS)
    assert request.sampling_params.seed == 42 and request.sampling_params.guidance_scale_provided
    assert options_from_sampling_params(request.sampling_params) == OPTIONS


def test_engine_kwargs_are_diffusion_config_fields():
    fields = {f.name for f in dataclasses.fields(OmniDiffusionConfig)}
    kwargs = engine_kwargs(parse_args(["--model", "m", "--engine-args", '{"enforce_eager": false}']))
    assert set(kwargs) <= fields and kwargs["enforce_eager"] is False


def test_worker_extension_builds_custom_pipelines():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

    from omni.rollout.vllm_worker import WORKER_EXTENSION_CLASS

    extension = resolve_obj_by_qualname(WORKER_EXTENSION_CLASS)
    assert issubclass(extension, CustomPipelineWorkerExtension)
    assert all(
        callable(getattr(extension, m))
        for m in ("omni_sync_weights", "omni_has_base", "omni_encode_prompts", "re_init_pipeline")
    )


def test_pipeline_answers_a_real_batch_through_the_real_formatter(tiny_sd3_dir):
    """forward(DiffusionRequestBatch) -> DiffusionOutput -> vLLM-Omni's formatter (SD3's
    post-process is the identity with output_type='latent') -> our reader: the same tensors
    as the local backend's emulation of that path."""
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import get_sd3_image_post_process_func

    post_process = get_sd3_image_post_process_func(SimpleNamespace(output_type="latent", model=str(tiny_sd3_dir)))
    pipeline = FlowGRPOPipeline(od_config=od_config(tiny_sd3_dir))
    requests = real_requests(["a red cat", "a blue dog"], [[1, 3], 2], OPTIONS)  # a prompt group, an image
    batch = DiffusionRequestBatch(requests=requests)
    assert batch.sampling_params_list[0].num_outputs_per_prompt == 2
    outputs = pipeline.forward(batch)
    emulated = pipeline.forward_fields(batch)
    assert len(outputs) == 2 and all(isinstance(o, DiffusionOutput) for o in outputs)
    config = SimpleNamespace(model_class_name="StableDiffusion3Pipeline")
    for request, output, fields in zip(requests, outputs, emulated):
        data = post_process(output.output)
        (formatted,) = format_diffusion_outputs(
            request=request,
            od_config=config,
            diffusion_output=output,
            output_data=data,
            postprocess_output=normalize_diffusion_postprocess_output(data),
        )
        got, want = result_from_output(formatted), result_from_output(emulate_request_output(fields))
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert torch.all(got["log_probs"][:, [0, 3]] == 0) and torch.all(got["log_probs"][:, 1:3] != 0)
        assert len(got["image"]) == len(got["latents"]) == request.sampling_params.num_outputs_per_prompt
