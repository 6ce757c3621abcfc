"""Our vLLM-Omni pipeline class, driven the way vLLM-Omni drives it (a batch of one-image
requests), samples exactly what the in-process diffusers engine samples."""

from types import SimpleNamespace

import pytest
import torch

from omni.models.sd3 import FAMILY, build_tiny_transformer
from omni.rollout import transport
from omni.rollout.vllm_pipeline import FlowGRPOPipeline
from omni.rollout.vllm_protocol import (
    CONVERTS_PAYLOAD,
    IMAGE_KEY,
    TAKES_TENSOR,
    collate_results,
    emulate_request_output,
    options_from_sampling_params,
    output_fields,
    prompt_groups,
    request_inputs,
    result_from_output,
)
from tests.rollout.conftest import LORA, od_config, options, random_lora

PROMPTS = ["a red cat", "a blue dog", "a red cat", "a green tree"]
SEEDS = [11, 12, 13, 14]
CASES = {
    "flow_grpo": options(),
    "cfg": options(guidance_scale=3.0),
    "sde_window": options(sde_steps=(1, 3)),
    # MixGRPO-Flash: steps 2 and 3 are DPM-Solver++(2M)'s second-order ODE steps
    "dpm2_after_window": options(num_steps=5, sde_steps=(0, 1), ode_solver="dpm2"),
}


def request_batch(prompts, seeds, opts, group_size: int = 1):
    """What vLLM-Omni's runner hands the pipeline: one request per image, or per run of equal
    prompts of at most `group_size` images."""
    requests = [request_inputs(p, s, opts) for p, s in prompt_groups(prompts, seeds, group_size)]
    return SimpleNamespace(
        prompts=[prompt for prompt, _ in requests],
        sampling_params_list=[SimpleNamespace(**sampling) for _, sampling in requests],
    )


def sample_through_pipeline(pipeline, prompts, seeds, opts, group_size: int = 1):
    fields = pipeline.forward_fields(request_batch(prompts, seeds, opts, group_size))
    return collate_results(
        prompts, [result_from_output(emulate_request_output(f)) for f in fields], opts, FAMILY.conditioning
    )


@pytest.fixture(scope="module")
def synced(tiny_sd3_dir, tmp_path_factory):
    """The diffusers engine and our pipeline (started without base weights), both given the
    same trained base and LoRA through the weight transport."""
    from omni.rollout.diffusers_engine import load_diffusers_engine
    from omni.weights import plain_base_names

    shared = tmp_path_factory.mktemp("shared")
    trained = build_tiny_transformer(seed=5)
    base = {k: v.detach() for k, v in plain_base_names(trained).items()}
    lora = random_lora(trained, seed=1)
    engine = load_diffusers_engine(
        FAMILY, tiny_sd3_dir, torch.device("cpu"), torch.float32, micro_batch_size=4, load_base=False
    )
    engine.update_weights(base, base_sync_done=False, lora=None)
    engine.update_weights(lora, base_sync_done=True, lora=LORA)
    pipeline = FlowGRPOPipeline(od_config=od_config(tiny_sd3_dir, load_base=False))
    pipeline.sync_weights_from(transport.write_base_weights(shared, "base", base))
    pipeline.sync_weights_from(transport.write_lora_adapter(shared, "lora", lora, LORA))
    return engine, pipeline


@pytest.mark.parametrize("case", CASES)
def test_pipeline_log_probs_equal_diffusers_engine(case, synced):
    engine, pipeline = synced
    opts = CASES[case]
    expected = engine.generate(PROMPTS, SEEDS, opts)
    got = sample_through_pipeline(pipeline, PROMPTS, SEEDS, opts)
    assert torch.isfinite(got.log_probs).all()
    assert (got.log_probs - expected.log_probs).abs().max() <= 1e-5
    assert (got.latents - expected.latents).abs().max() <= 1e-5
    assert (got.images - expected.images).abs().max() <= 1e-5
    assert torch.equal(got.sigmas, expected.sigmas)
    for name in ("embeds", "pooled", "neg_embeds", "neg_pooled"):
        want = getattr(expected.cond, name)
        assert (want is None) == (getattr(got.cond, name) is None), name
        if want is not None:
            assert torch.allclose(getattr(got.cond, name), want, atol=1e-6), name
    start, stop = opts.sde_steps
    ode_steps = [j for j in range(opts.num_steps) if not start <= j < stop]
    assert torch.all(got.log_probs[:, ode_steps] == 0) and torch.all(got.log_probs[:, start:stop] != 0)


def test_an_image_does_not_depend_on_its_batch(synced):
    """vLLM-Omni decides which requests share a forward; an image depends only on its seed."""
    _, pipeline = synced
    opts = CASES["flow_grpo"]
    together = sample_through_pipeline(pipeline, PROMPTS, SEEDS, opts)
    alone = sample_through_pipeline(pipeline, PROMPTS[1:2], SEEDS[1:2], opts)
    assert (together.log_probs[1] - alone.log_probs[0]).abs().max() <= 1e-5
    assert (together.latents[1] - alone.latents[0]).abs().max() <= 1e-5


def test_requests_with_different_options_in_one_batch(synced):
    _, pipeline = synced
    plain, window = CASES["flow_grpo"], CASES["sde_window"]
    batch = request_batch(PROMPTS[:2], SEEDS[:2], plain)
    other = request_batch(PROMPTS[2:], SEEDS[2:], window)
    mixed = SimpleNamespace(
        prompts=batch.prompts + other.prompts,
        sampling_params_list=batch.sampling_params_list + other.sampling_params_list,
    )
    fields = pipeline.forward_fields(mixed)
    results = [result_from_output(emulate_request_output(f)) for f in fields]
    expected = sample_through_pipeline(pipeline, PROMPTS[2:], SEEDS[2:], window)
    assert torch.equal(torch.cat([r["log_probs"] for r in results[2:]]), expected.log_probs)
    assert torch.all(torch.cat([r["log_probs"] for r in results[2:]])[:, 0] == 0)


def test_a_prompt_groups_request_samples_each_image_from_its_seed(synced):
    """A request per prompt group (`num_outputs_per_prompt` images, a seed each) samples what
    a request per image samples, in fewer requests; a run longer than the group splits."""
    _, pipeline = synced
    opts = CASES["sde_window"]
    prompts, seeds = ["a red cat"] * 3 + ["a blue dog"] * 2, [21, 22, 23, 24, 25]
    batch = request_batch(prompts, seeds, opts, group_size=2)
    assert [p["prompt"] for p in batch.prompts] == ["a red cat", "a red cat", "a blue dog"]
    assert [s.num_outputs_per_prompt for s in batch.sampling_params_list] == [2, 1, 2]
    assert [g.initial_seed() for g in batch.sampling_params_list[0].generator] == [21, 22]
    grouped = sample_through_pipeline(pipeline, prompts, seeds, opts, group_size=2)
    alone = sample_through_pipeline(pipeline, prompts, seeds, opts)
    for name in ("log_probs", "latents", "images"):
        assert (getattr(grouped, name) - getattr(alone, name)).abs().max() <= 1e-5, name
    assert torch.allclose(grouped.cond.embeds, alone.cond.embeds, atol=1e-6)
    assert not torch.allclose(grouped.latents[0], grouped.latents[1])  # each image its own seed


def test_request_round_trips_the_options():
    opts = options(guidance_scale=4.5, noise_level=0.9, sde_steps=(2, 4))
    prompt, sampling = request_inputs("a cat", 123, opts)
    assert prompt == {"prompt": "a cat"} and sampling["seed"] == 123
    assert options_from_sampling_params(SimpleNamespace(**sampling)) == opts
    cps = options(noise_level=0.5, sde_steps=(0, 3), sde_type="cps")  # the engine samples the same step
    assert options_from_sampling_params(SimpleNamespace(**request_inputs("a cat", 1, cps)[1])) == cps
    flash = options(sde_steps=(0, 2), ode_solver="dpm2")  # and the same ODE steps
    assert options_from_sampling_params(SimpleNamespace(**request_inputs("a cat", 1, flash)[1])) == flash
    clip = options(num_frames=9)  # a video family's clips keep their length
    assert options_from_sampling_params(SimpleNamespace(**request_inputs("a cat", 1, clip)[1])) == clip


@pytest.mark.parametrize("post_process", [CONVERTS_PAYLOAD, TAKES_TENSOR])
def test_an_image_a_post_process_would_convert_rides_in_the_metadata(synced, post_process):
    """Qwen-Image's post-process makes PIL images of the payload, FLUX.1 Kontext's of an image
    tensor (it takes nothing else): the reader takes the exact fp32 image from the metadata
    group, which rides in the envelope or beside the trajectory's latents."""
    _, pipeline = synced
    batch = pipeline.sample(PROMPTS[:3], SEEDS[:3], CASES["flow_grpo"])
    rows = [1, 2]  # one request's two outputs
    fields = output_fields(batch, rows, post_process=post_process)
    image = fields["output"]["payload"]["image"] if post_process == CONVERTS_PAYLOAD else fields["output"]
    assert image.shape == (2, *batch.images.shape[1:])  # a batch in [-1, 1]
    output = emulate_request_output(fields)
    output.images = [
        (i / 2 + 0.5).mul(255).round().byte().permute(1, 2, 0).numpy() for i in output.images[0]
    ]  # as converted, an image each
    result, plain = result_from_output(output), result_from_output(emulate_request_output(output_fields(batch, rows)))
    assert torch.equal(result[IMAGE_KEY], batch.images[rows]) and torch.equal(plain[IMAGE_KEY], batch.images[rows])
    assert torch.equal(result["latents"], batch.latents[rows])
    assert set(result) == set(plain)
    with pytest.raises(ValueError, match="post_process='pil'"):
        output_fields(batch, rows, post_process="pil")


def test_warm_up_request_without_our_options_samples_ode(tiny_sd3_dir):
    """vLLM-Omni's start-up warm-up sends a bare request (2 steps, 512 px, no CFG)."""
    pipeline = FlowGRPOPipeline(od_config=od_config(tiny_sd3_dir))
    warm_up = SimpleNamespace(
        prompts=[{"prompt": "dummy run"}],
        sampling_params_list=[
            SimpleNamespace(
                num_inference_steps=2,
                height=128,
                width=128,
                guidance_scale=0.0,
                max_sequence_length=None,
                seed=7,
                extra_args={},
            )
        ],
    )
    (fields,) = pipeline.forward_fields(warm_up)
    assert torch.all(fields["trajectory_log_probs"] == 0)
    assert fields["output"]["payload"]["image"].shape == (1, 3, 128, 128)  # the request's one output


def test_pipeline_refuses_checkpoint_weights_from_the_loader(tiny_sd3_dir):
    pipeline = FlowGRPOPipeline(od_config=od_config(tiny_sd3_dir))
    assert pipeline.load_weights(iter(())) is None  # what vLLM-Omni's loader passes at start
    with pytest.raises(ValueError, match="sync_weights_from"):
        pipeline.load_weights(iter([("transformer.x", torch.zeros(1))]))
