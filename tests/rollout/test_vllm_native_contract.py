"""The native backend against the installed vLLM-Omni (skipped without vllm_omni, which
lives in the engine env; run there with
`ENV/bin/python -m pytest -n 0 tests/rollout/test_vllm_native_contract.py`): our base-weight
names fill every parameter of its real SD3 and FLUX transformers once, after which each
computes the diffusers transformer's velocity; its pipelines have the hooks we use."""

import json

import pytest
import torch

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed here (it lives in the engine env: scripts/install_vllm_engine.sh)")

from omni.distributed import free_port  # noqa: E402
from omni.models.flux import TINY_TRANSFORMER as FLUX_TINY, image_ids  # noqa: E402
from omni.models.sd3 import build_tiny_transformer  # noqa: E402
from omni.rollout.native_support import hook_problems, missing_hooks  # noqa: E402
from omni.rollout.vllm_native import keep_linear_weights, load_native_base, native_targets  # noqa: E402
from omni.weights import plain_base_names  # noqa: E402


# SD3 as built by the tiny builder, and with SD3.5's parts (RMS-normed q/k, a second
# attention in the first blocks), which gpu_check_vllm.py's SD3.5-Medium shape has
SHAPES = {"sd3": {}, "sd3.5": {"qk_norm": "rms_norm", "dual_attention_layers": [0]}}


@pytest.fixture(scope="module")
def parallel_group():
    from vllm_omni.diffusion.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
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
        hidden_states=torch.randn(2, 4, 8, 8, generator=generator), encoder_hidden_states=torch.randn(2, 10, 64, generator=generator),
        pooled_projections=torch.randn(2, 64, generator=generator), timestep=torch.tensor([900.0, 250.0]), return_dict=False,
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
        hidden_states=torch.randn(2, tokens, 64, generator=generator), encoder_hidden_states=torch.randn(2, text, 64, generator=generator),
        pooled_projections=torch.randn(2, 32, generator=generator), timestep=torch.tensor([0.9, 0.25]), guidance=torch.tensor([3.5, 3.5]),
        txt_ids=torch.zeros(text, 3), img_ids=image_ids(tokens, "cpu", torch.float32), return_dict=False,
    )
    with torch.no_grad(), set_forward_context(omni_diffusion_config=config):
        got = module(**inputs)[0]
        want = reference(**inputs)[0]
        other_guidance = reference(**{**inputs, "guidance": torch.tensor([1.0, 1.0])})[0]
    assert (got - want).abs().max() <= 1e-5 < (other_guidance - want).abs().max()
    with pytest.raises(KeyError, match="missing"):
        load_native_base(module, "flux", {k: v for k, v in plain.items() if "single_transformer_blocks.0.attn.to_k" not in k})


def test_the_installed_vllm_omni_has_the_hooks():
    assert hook_problems("sd3") is None and hook_problems("flux") is None
    assert "model.family=qwen_image" in hook_problems("qwen_image")


def test_a_pipeline_without_a_hook_is_named():
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline

    older = type("OlderPipeline", (torch.nn.Module,), {"forward": StableDiffusion3Pipeline.forward})
    assert missing_hooks(older, ("diffuse", "forward", "scheduler_step")) == ["diffuse", "scheduler_step"]
