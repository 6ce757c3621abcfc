"""Base-weight names for the native backend: collect_lora_params' plain names of the tiny
SD3, FLUX and Qwen-Image -> vLLM-Omni's parameters and shards, each filled exactly once. (Against
vLLM-Omni's real transformers: tests/rollout/test_vllm_native_contract.py, in the engine env.)"""

import pytest

from omni.models.flux import FAMILY as FLUX
from omni.models.qwen_image import FAMILY as QWEN
from omni.models.sd3 import build_tiny_transformer
from omni.rollout.native_names import check_complete, expected_targets, native_module, native_name, native_names
from omni.weights import plain_base_names

PLAIN = list(plain_base_names(build_tiny_transformer(0)))
FLUX_PLAIN = list(plain_base_names(FLUX.meta_transformer()))  # names only: built on the meta device
QWEN_PLAIN = list(plain_base_names(QWEN.meta_transformer()))


def test_every_plain_name_has_its_own_target():
    targets = native_names("sd3", PLAIN)
    assert set(targets) == set(PLAIN) and len(set(targets.values())) == len(PLAIN)
    fused = {t for t in targets.values() if t[1] is not None}
    # the tiny SD3 has 2 blocks: to_q/k/v and add_q/k/v_proj, weight and bias, in each
    assert len(fused) == 2 * 2 * 6
    assert native_name("sd3", "transformer_blocks.1.attn.add_k_proj.bias") == (
        "transformer_blocks.1.attn.add_kv_proj.bias",
        "k",
    )
    assert native_name("sd3", "transformer_blocks.0.attn.to_out.0.weight") == (
        "transformer_blocks.0.attn.to_out.0.weight",
        None,
    )


def test_flux_double_and_single_blocks_fuse_their_projections():
    """FLUX's double block fuses both streams' q/k/v, its single block (no context stream,
    no to_out) its own q/k/v; proj_mlp and proj_out stay apart."""
    targets = native_names("flux", FLUX_PLAIN)
    assert len(set(targets.values())) == len(FLUX_PLAIN)
    fused = {t for t in targets.values() if t[1] is not None}
    # one double block (6 projections) and one single block (3), weight and bias each
    assert len(fused) == 2 * (6 + 3)
    assert native_name("flux", "single_transformer_blocks.0.attn.to_v.weight") == (
        "single_transformer_blocks.0.attn.to_qkv.weight",
        "v",
    )
    assert native_name("flux", "single_transformer_blocks.0.proj_mlp.weight") == (
        "single_transformer_blocks.0.proj_mlp.weight",
        None,
    )
    fused_names = sorted({target for target, _ in targets.values()})
    check_complete("flux", targets.values(), fused_names)


def test_qwen_image_fuses_both_streams_and_renames_its_output_projection():
    """vLLM-Omni's Qwen-Image fuses q/k/v as SD3 does and names diffusers' `to_out.0` (the
    first entry of a list) `to_out`; nothing else moves (`to_add_out`, the MLPs, `img_in`)."""
    targets = native_names("qwen_image", QWEN_PLAIN)
    assert len(set(targets.values())) == len(QWEN_PLAIN)
    fused = {t for t in targets.values() if t[1] is not None}
    assert len(fused) == 2 * 2 * 6  # 2 blocks x (to_q/k/v, add_q/k/v_proj) x (weight, bias)
    assert native_name("qwen_image", "transformer_blocks.1.attn.to_out.0.bias") == (
        "transformer_blocks.1.attn.to_out.bias",
        None,
    )
    assert native_name("qwen_image", "transformer_blocks.1.attn.to_add_out.weight") == (
        "transformer_blocks.1.attn.to_add_out.weight",
        None,
    )
    assert (
        native_name("qwen_image", "transformer_blocks.0.img_mlp.net.0.proj.weight")[0]
        == "transformer_blocks.0.img_mlp.net.0.proj.weight"
    )
    assert not any(".to_out.0." in target for target, _ in targets.values())
    check_complete("qwen_image", targets.values(), sorted({target for target, _ in targets.values()}))
    # a LoRA adapter's names and target modules take the same rename; SD3 keeps to_out.0
    assert native_module("qwen_image", "base_model.model.transformer_blocks.0.attn.to_out.0.lora_A.weight").endswith(
        "attn.to_out.lora_A.weight"
    )
    assert native_module("qwen_image", "to_out.0") == "to_out" and native_module("sd3", "to_out.0") == "to_out.0"


def test_the_fused_names_complete_vllm_omnis_parameters():
    """vLLM-Omni's names are the plain ones with to_q/k/v fused into to_qkv (the contract
    test checks that against its real module): a full sync fills each once."""
    targets = native_names("sd3", PLAIN)
    fused_names = sorted({target for target, _ in targets.values()})
    check_complete("sd3", targets.values(), fused_names)
    assert expected_targets("sd3", fused_names) == set(targets.values())


def test_a_missing_or_doubled_tensor_is_named():
    targets = native_names("sd3", PLAIN)
    fused_names = {target for target, _ in targets.values()}
    short = [t for name, t in targets.items() if name != "transformer_blocks.0.attn.to_v.weight"]
    with pytest.raises(KeyError, match=r"1 missing \[\('transformer_blocks.0.attn.to_qkv.weight', 'v'\)\]"):
        check_complete("sd3", short, fused_names)
    with pytest.raises(KeyError, match="both map to"):
        native_names("sd3", ["x.to_q.weight", "x.to_q.weight"])


def test_wan_fuses_its_self_attention_only_and_moves_its_renamed_parts():
    """vLLM-Omni's Wan fuses the self-attention's (`attn1`) q/k/v and keeps the cross-attention's
    (`attn2`) apart, names `to_out.0` and the feed-forward's `net.0`/`net.2` `to_out`,
    `net_0`/`net_2`, and keeps the output's root `scale_shift_table` in a module (each block's
    own table stays where it is)."""
    from omni.models.wan import FAMILY as WAN

    plain = list(plain_base_names(WAN.meta_transformer()))
    targets = native_names("wan", plain)
    assert len(set(targets.values())) == len(plain)
    fused = {t for t in targets.values() if t[1] is not None}
    assert len(fused) == 2 * 3 * 2  # 2 blocks x attn1's q/k/v x (weight, bias)
    assert native_name("wan", "blocks.1.attn1.to_k.weight") == ("blocks.1.attn1.to_qkv.weight", "k")
    assert native_name("wan", "blocks.1.attn2.to_k.weight") == ("blocks.1.attn2.to_k.weight", None)
    assert native_name("wan", "blocks.0.ffn.net.2.bias") == ("blocks.0.ffn.net_2.bias", None)
    assert native_name("wan", "blocks.0.attn2.to_out.0.bias") == ("blocks.0.attn2.to_out.bias", None)
    assert native_name("wan", "scale_shift_table") == ("output_scale_shift_prepare.scale_shift_table", None)
    assert native_name("wan", "blocks.0.scale_shift_table") == ("blocks.0.scale_shift_table", None)
    check_complete("wan", targets.values(), sorted({target for target, _ in targets.values()}))
    assert WAN.native.fused_module("blocks.0.attn1.to_v") == ("blocks.0.attn1.to_qkv", "v")
    assert WAN.native.fused_module("blocks.0.attn2.to_v") is None


def test_wan_heads_whose_rotary_split_vllm_omni_applies_otherwise_are_named():
    """vLLM-Omni's Wan builds its rotary tables split (d - 4 (d // 6), 2 (d // 6), 2 (d // 6))
    and applies them split (d - 2 (d // 3), d // 3, d // 3): the same for 128 (published Wan)
    and 24, not for the tiny Wan's 16 (tests/rollout/test_vllm_native_contract.py measures it)."""
    from omni.models.wan import FAMILY as WAN

    assert WAN.native.transformer_problem({"attention_head_dim": 128}) is None
    assert WAN.native.transformer_problem({"attention_head_dim": 24}) is None
    assert "split (6, 5, 5) but builds them (8, 4, 4)" in WAN.native.transformer_problem({"attention_head_dim": 16})


def test_wan_rollouts_step_the_checkpoints_euler_flow_not_vllm_omnis_solver(tiny_wan_dir):
    """vLLM-Omni's Wan builds a UniPC solver of the engine's `flow_shift` and rebuilds it for a
    request that asks for another solver; `prepare` (run on its pipeline at start-up) puts its
    loop on the Euler path and the checkpoint's own scheduler in place, which our scheduler
    is built from. A stand-in for vLLM-Omni's pipeline (it lives in the engine env) with the
    two attributes `prepare` sets; the real one: tests/rollout/test_vllm_cpu_smoke.py."""
    from types import SimpleNamespace

    from omni.models.wan import FAMILY as WAN
    from omni.models.wan import TINY_SHIFT, euler_scheduler

    pipe = SimpleNamespace(od_config=SimpleNamespace(model=str(tiny_wan_dir)), _sample_solver="unipc", scheduler=None)
    WAN.native.prepare(pipe)
    assert pipe._sample_solver == "euler"
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.scheduler.config.shift == TINY_SHIFT
    # a published checkpoint's UniPC solver: the Euler flow of its flow_shift
    published = {"_class_name": "UniPCMultistepScheduler", "flow_shift": 5.0, "use_flow_sigmas": True}
    assert type(euler_scheduler(published)).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert euler_scheduler(published).config.shift == 5.0
