"""The native backend against the installed vLLM-Omni (skipped without vllm_omni, which
lives in the engine env; run there with
`ENV/bin/python -m pytest -n 0 tests/rollout/test_vllm_native_contract.py`): our base-weight
names fill every parameter of its real SD3, FLUX, Qwen-Image and Wan transformers once, after which
each computes the diffusers transformer's velocity; its pipelines have the hooks we use;
Qwen-Image's requests, LoRA adapters and post-processed answers reach it as we mean them."""

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "vllm_omni", reason="vLLM-Omni is not installed here (it lives in the engine env: scripts/install_vllm_engine.sh)"
)

from omni.distributed import free_port  # noqa: E402
from omni.models import get_family  # noqa: E402
from omni.models.flux import TINY_TRANSFORMER as FLUX_TINY  # noqa: E402
from omni.models.flux import image_ids
from omni.models.qwen_image import FAMILY as QWEN  # noqa: E402
from omni.models.qwen_image import NEGATIVE_PROMPT, velocity
from omni.models.qwen_image import TINY_TRANSFORMER as QWEN_TINY
from omni.models.sd3 import build_tiny_transformer  # noqa: E402
from omni.models.wan import TINY_TRANSFORMER as WAN_TINY  # noqa: E402
from omni.rollout.native_support import hook_problems, missing_hooks, request_guidance  # noqa: E402
from omni.rollout.vllm_native import NativeRollout, keep_linear_weights, load_native_base, native_targets  # noqa: E402
from omni.weights import plain_base_names  # noqa: E402

# SD3 as built by the tiny builder, and with SD3.5's parts (RMS-normed q/k, a second
# attention in the first blocks), which gpu_check_vllm.py's SD3.5-Medium shape has
SHAPES = {"sd3": {}, "sd3.5": {"qk_norm": "rms_norm", "dual_attention_layers": [0]}}


@pytest.fixture(scope="module")
def parallel_group():
    from vllm_omni.diffusion.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo"
    )
    initialize_model_parallel(backend="gloo")


def native_transformer(model_dir, cls, overrides=None):
    """vLLM-Omni's transformer `cls` of the tiny checkpoint's config (with `overrides`),
    built as its pipeline builds it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.data import OmniDiffusionConfig, TransformerConfig
    from vllm_omni.diffusion.utils.tf_utils import get_transformer_config_kwargs

    config = OmniDiffusionConfig(model=str(model_dir), dtype=torch.float32)
    values = {**json.loads((model_dir / "transformer" / "config.json").read_text()), **(overrides or {})}
    config.set_tf_model_config(TransformerConfig.from_dict(values))
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops (RMSNorm) read it when built
        module = cls(**get_transformer_config_kwargs(config.tf_model_config, cls), od_config=config)
    keep_linear_weights(module)
    return module, config


def after_loading(module):
    """What vLLM's loader does once the weights are in."""
    for layer in module.modules():
        if hasattr(layer, "quant_method"):
            layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("shape", SHAPES)
def test_base_names_fill_every_parameter_once_and_give_the_same_velocity(shape, tiny_sd3_dir, parallel_group):
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.models.sd3.sd3_transformer import SD3Transformer2DModel

    module, config = native_transformer(tiny_sd3_dir, SD3Transformer2DModel, SHAPES[shape])
    reference = build_tiny_transformer(seed=3, **SHAPES[shape])
    plain = {k: v.detach() for k, v in plain_base_names(reference).items()}
    assert load_native_base(module, "sd3", plain) == len(plain)
    fused = {n for n in native_targets(module) if ".to_qkv." in n or ".add_kv_proj." in n}
    assert fused and all(n.replace("to_qkv", "to_q").replace("add_kv_proj", "add_q_proj") in plain for n in fused)
    after_loading(module)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=generator),
        encoder_hidden_states=torch.randn(2, 10, 64, generator=generator),
        pooled_projections=torch.randn(2, 64, generator=generator),
        timestep=torch.tensor([900.0, 250.0]),
        return_dict=False,
    )
    with torch.no_grad(), set_forward_context(omni_diffusion_config=config):
        got = module(**inputs)[0]
        want = reference(**inputs)[0]
    assert (got - want).abs().max() <= 1e-5
    with pytest.raises(KeyError, match="missing"):
        load_native_base(module, "sd3", {k: v for k, v in plain.items() if "to_k" not in k})


def test_flux_base_names_fill_every_parameter_once_and_give_the_same_velocity(tiny_flux_dir, parallel_group):
    """Both block kinds (the single block's fused q/k/v next to its separate proj_mlp and
    proj_out), the guidance embedding, FLUX's sigma timestep (scaled by 1000 inside)."""
    from diffusers import FluxTransformer2DModel
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.models.flux.flux_transformer import FluxTransformer2DModel as NativeFlux

    module, config = native_transformer(tiny_flux_dir, NativeFlux)
    torch.manual_seed(3)
    reference = FluxTransformer2DModel(**FLUX_TINY)
    plain = {k: v.detach() for k, v in plain_base_names(reference).items()}
    assert load_native_base(module, "flux", plain) == len(plain)
    after_loading(module)
    generator = torch.Generator().manual_seed(0)
    tokens, text = 16, 10
    inputs = dict(
        hidden_states=torch.randn(2, tokens, 64, generator=generator),
        encoder_hidden_states=torch.randn(2, text, 64, generator=generator),
        pooled_projections=torch.randn(2, 32, generator=generator),
        timestep=torch.tensor([0.9, 0.25]),
        guidance=torch.tensor([3.5, 3.5]),
        txt_ids=torch.zeros(text, 3),
        img_ids=image_ids(tokens, "cpu", torch.float32),
        return_dict=False,
    )
    with torch.no_grad(), set_forward_context(omni_diffusion_config=config):
        got = module(**inputs)[0]
        want = reference(**inputs)[0]
        other_guidance = reference(**{**inputs, "guidance": torch.tensor([1.0, 1.0])})[0]
    assert (got - want).abs().max() <= 1e-5 < (other_guidance - want).abs().max()
    with pytest.raises(KeyError, match="missing"):
        load_native_base(
            module, "flux", {k: v for k, v in plain.items() if "single_transformer_blocks.0.attn.to_k" not in k}
        )


def test_qwen_image_base_names_fill_every_parameter_once_and_give_the_same_velocity(
    tiny_qwen_image_dir, parallel_group
):
    """Qwen-Image's fused q/k/v of both streams and its `to_out` (diffusers' `to_out.0`);
    `img_in`, registered twice, is filled once. vLLM-Omni's transformer, called as its loop
    calls it (a batch padded to its longest prompt, the mask, the padded width as text
    lengths), gives the actor's velocity (each prompt cut to the batch's longest)."""
    from diffusers import QwenImageTransformer2DModel
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel as NativeQwen

    module, config = native_transformer(tiny_qwen_image_dir, NativeQwen)
    torch.manual_seed(3)
    reference = QwenImageTransformer2DModel(**QWEN_TINY)
    plain = {k: v.detach() for k, v in plain_base_names(reference).items()}
    assert load_native_base(module, "qwen_image", plain) == len(plain)
    assert "img_in.weight" in native_targets(module) and "image_rope_prepare.img_in.weight" not in native_targets(
        module
    )
    after_loading(module)
    generator = torch.Generator().manual_seed(0)
    latents, embeds = torch.randn(2, 16, 64, generator=generator), torch.randn(2, 10, 32, generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    embeds[1, 7:] = 0
    timestep = torch.tensor([0.9, 0.25])
    with torch.no_grad(), set_forward_context(omni_diffusion_config=config):
        got = module(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, 4, 4)]] * 2,
            txt_seq_lens=[10, 10],
            return_dict=False,
        )[0]
        want = velocity(reference, latents, timestep, embeds, mask)
    assert (got - want).abs().max() <= 1e-5
    with pytest.raises(KeyError, match="missing"):
        load_native_base(module, "qwen_image", {k: v for k, v in plain.items() if ".to_out.0." not in k})


@pytest.mark.parametrize("head_dim", [24, 16])
def test_wan_base_names_fill_every_parameter_once_and_give_the_same_velocity(head_dim, tiny_wan_dir, parallel_group):
    """Wan's self-attention q/k/v fused (the cross-attention's apart), its renamed `to_out`,
    feed-forward layers and output `scale_shift_table`: vLLM-Omni's transformer, built as its
    pipeline builds it, gives the diffusers transformer's velocity on a clip where its rotary
    split agrees with diffusers' (heads of 24 channels, as of 128); with the tiny Wan's 16 it
    does not, which the family's native facts name (`WanNative.transformer_problem`)."""
    from diffusers import WanTransformer3DModel
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import create_transformer_from_config

    from omni.models.wan import FAMILY as WAN

    config = {**json.loads((tiny_wan_dir / "transformer" / "config.json").read_text()), "attention_head_dim": head_dim}
    with set_current_vllm_config(VllmConfig()):
        module = create_transformer_from_config(config)
    keep_linear_weights(module)
    torch.manual_seed(3)
    reference = WanTransformer3DModel(**{**WAN_TINY, "attention_head_dim": head_dim})
    plain = {k: v.detach() for k, v in plain_base_names(reference).items()}
    assert load_native_base(module, "wan", plain) == len(plain)
    after_loading(module)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 16, 2, 8, 8, generator=generator),
        timestep=torch.tensor([900.0, 250.0]),
        encoder_hidden_states=torch.randn(2, 10, WAN_TINY["text_dim"], generator=generator),
        return_dict=False,
    )
    with torch.no_grad(), set_forward_context(omni_diffusion_config=OmniDiffusionConfig(model=str(tiny_wan_dir))):
        gap = (module(**inputs)[0] - reference(**inputs)[0]).abs().max()
    problem = WAN.native.transformer_problem(config)
    if head_dim == 24:
        assert problem is None and gap <= 1e-5
    else:
        assert "attention_head_dim=16" in problem and gap > 1e-4
    with pytest.raises(KeyError, match="missing"):
        load_native_base(module, "wan", {k: v for k, v in plain.items() if k != "scale_shift_table"})


def test_qwen_image_requests_ask_for_true_cfg_on_the_negative_prompt():
    """vLLM-Omni's Qwen-Image reads the negative prompt from the prompt and the scale from the
    sampling params; without a negative prompt it runs no CFG pass."""
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    prompt_fields, sampling_fields = request_guidance("qwen_image", 3.0)
    params = OmniDiffusionSamplingParams(**sampling_fields)
    assert params.true_cfg_scale == 3.0
    assert QwenImagePipeline._extract_prompts(None, [{"prompt": "a cat", **prompt_fields}]) == (
        ["a cat"],
        [NEGATIVE_PROMPT],
    )
    assert (
        QwenImagePipeline._extract_prompts(None, [{"prompt": "a cat", **request_guidance("qwen_image", 1.0)[0]}])[1]
        is None
    )


def test_qwen_image_lora_adapters_are_renamed_for_its_to_out(tmp_path):
    """A PEFT adapter on diffusers' `to_out.0` loads into vLLM-Omni's `to_out` (its LoRA
    manager's target matching and lookup by module name), with every other module kept."""
    from diffusers import QwenImageTransformer2DModel
    from vllm.lora.request import LoRARequest
    from vllm_omni.diffusion.lora.utils import _match_target_modules

    from omni.config.model import LoraConfig
    from omni.rollout.transport import write_lora_adapter
    from tests.rollout.conftest import random_lora

    config = LoraConfig(rank=4, alpha=8.0, target_modules=list(QWEN.lora_targets))
    torch.manual_seed(0)
    path = write_lora_adapter(
        tmp_path, "lora-1", random_lora(QwenImageTransformer2DModel(**QWEN_TINY), lora=config), config
    )
    pipeline = SimpleNamespace(family_name="qwen_image")
    model, helper = NativeRollout._load_diffusion_lora_adapter(
        pipeline, LoRARequest("lora-1", 1, str(path)), str(path), torch.float32
    )
    assert "to_out" in helper.target_modules and "to_out.0" not in helper.target_modules
    assert _match_target_modules("transformer.transformer_blocks.0.attn.to_out", helper.target_modules)
    out = model.get_lora("transformer_blocks.0.attn.to_out")
    assert out is not None and out.lora_a.shape[0] == 4 and model.get_lora("transformer_blocks.0.attn.to_out.0") is None
    assert model.get_lora("transformer_blocks.1.attn.add_k_proj") is not None
    assert (
        NativeRollout._load_diffusion_lora_adapter(SimpleNamespace(family_name="sd3"), None, str(path), torch.float32)
        is None
    )


# family -> (vLLM-Omni's post-process getter, its pipeline class, the tiny checkpoint's fixture)
POST_PROCESSED = {
    "qwen_image": (
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image.get_qwen_image_post_process_func",
        "QwenImagePipeline",
        "tiny_qwen_image_dir",
    ),
    "flux_kontext": (
        "vllm_omni.diffusion.models.flux.pipeline_flux_kontext.get_flux_kontext_post_process_func",
        "FluxKontextPipeline",
        "tiny_flux_kontext_dir",
    ),
    "qwen_image_edit_plus": (
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus.get_qwen_image_edit_plus_post_process_func",
        "QwenImageEditPlusPipeline",
        "tiny_qwen_image_edit_plus_dir",
    ),
}


@pytest.mark.parametrize("family_name", sorted(POST_PROCESSED))
def test_answers_survive_the_familys_post_process(family_name, request):
    """vLLM-Omni's Qwen-Image post-process makes PIL images of the payload even with
    output_type latent, FLUX.1 Kontext's and Qwen-Image-Edit-Plus's take an image tensor only; through each and the
    real formatter, the reader still gets the exact fp32 image and the conditioning."""
    import importlib

    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.output_formatter import format_diffusion_outputs, normalize_diffusion_postprocess_output
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    from omni.rollout.base import RolloutBatch
    from omni.rollout.vllm_protocol import output_fields, request_inputs, result_from_output
    from tests.rollout.conftest import options

    getter, class_name, model_dir = POST_PROCESSED[family_name]
    family = get_family(family_name)
    opts = options()
    generator = torch.Generator().manual_seed(0)
    given = {
        "qwen_image": lambda: (torch.randn(1, 16, 32, generator=generator), torch.ones(1, 16, dtype=torch.long)),
        "flux_kontext": lambda: (
            torch.randn(1, 16, 32, generator=generator),
            torch.randn(1, 32, generator=generator),
            torch.randn(1, 16, 8, 8, generator=generator),
        ),
        "qwen_image_edit_plus": lambda: (
            torch.randn(1, 16, 32, generator=generator),
            torch.ones(1, 16, dtype=torch.long),
            torch.randn(1, 64, 64, generator=generator),
            torch.tensor([[(8, 8)]]),
        ),
    }[family_name]()
    cond = family.conditioning(*given)
    latents, log_probs = torch.randn(1, 5, 16, 64, generator=generator), torch.randn(1, 4, generator=generator)
    images = torch.rand(1, 3, 64, 64, generator=generator)
    batch = RolloutBatch(["a cat"], images, latents, log_probs, torch.linspace(1, 0, 5), cond, opts)
    output = DiffusionOutput(**output_fields(batch, [0], post_process=family.native.post_process))
    module, _, name = getter.rpartition(".")
    model = str(request.getfixturevalue(model_dir))
    post_process = getattr(importlib.import_module(module), name)(SimpleNamespace(output_type="latent", model=model))
    prompt, sampling = request_inputs("a cat", 1, opts)
    request_ = OmniDiffusionRequest(
        prompt=prompt, sampling_params=OmniDiffusionSamplingParams(**sampling), request_id="r0"
    )
    data = post_process(output.output)
    (formatted,) = format_diffusion_outputs(
        request=request_,
        od_config=SimpleNamespace(model_class_name=class_name),
        diffusion_output=output,
        output_data=data,
        postprocess_output=normalize_diffusion_postprocess_output(data),
    )
    result = result_from_output(formatted)
    assert torch.equal(result["image"], images) and torch.equal(result["log_probs"], log_probs)
    assert torch.equal(result["latents"], latents)
    for field, tensor in cond.tensors().items():
        assert torch.equal(result[field], tensor), field


def test_the_installed_vllm_omni_has_the_hooks():
    assert all(
        hook_problems(family) is None
        for family in ("sd3", "flux", "flux_kontext", "qwen_image", "qwen_image_edit_plus", "wan")
    )
    assert "model.family=wan22" in hook_problems("wan22")  # its two experts: not extended


def test_a_pipeline_without_a_hook_is_named():
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline

    older = type("OlderPipeline", (torch.nn.Module,), {"forward": StableDiffusion3Pipeline.forward})
    assert missing_hooks(older, ("diffuse", "forward", "scheduler_step")) == ["diffuse", "scheduler_step"]
