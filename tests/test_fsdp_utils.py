"""Tests for omni.fsdp_utils: collecting LoRA/base weights from plain, FSDP1 and FSDP2 models.

The distributed cells run on CPU in one real 2-process gloo group, started once for the
whole module: every wrapping x layered x base_sync_done x adapter case x {fresh, after an
AdamW step} cell, the error cells and the summon cells run there, each rank records its
findings per cell in a JSON file, and the parametrized tests below assert on them (the
cell's checks, and that all ranks returned bit-identical tensors). The cells that need 4
ranks run the same way in a 4-process group. One cell runs a whole ActorRolloutWorker on the
tiny Wan in the 2-process group (the actor under FSDP2): the LoRA sync is exact at the
worker's level, the actor's log-probs those of the engine (the Ray group test runs the other
families' workers, in their own processes).

References are the same models unwrapped (same seeds, same optimizer step on the same
batch, so FSDP's averaged gradient equals the plain one): `peft.get_peft_model_state_dict`
of the reference for LoRA, the plain transformer's `state_dict()` for base weights (LoRA
freezes the base, so training does not change it).

FSDP2 mixed precision (bf16 compute, fp32 master parameters) gets its own cells, in the
states where FSDP2 leaves modules unsharded with bf16 compute copies registered (after a
no_grad forward, between a forward and its backward; the root by default, every block with
`reshard_after_forward=False`), with CPU offload, and on 4 ranks with HSDP (2 x 2 mesh) and
a partial post-forward reshard. Their reference is the fp32 masters, read (`full_tensor()`)
while every parameter is sharded, copied into an unwrapped model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from datetime import timedelta

import pytest
import torch
from torch import nn

from omni.distributed import free_port
from tests import cli_process

WORLD = 2
WORLD4 = 4  # HSDP (2 x 2 mesh) and partial post-forward resharding need 4 ranks
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]  # proj_out: a root-level Linear
SD3_PREFIXES = ("transformer_blocks.",)
FLUX_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.")
WAN_PREFIXES = ("blocks.",)
# Wan's forward reads its time embedder's first parameter (for its dtype), which FSDP1 without
# use_orig_params flattens away; our workers shard with use_orig_params=True or FSDP2.
WAN_WRAPPINGS = ("plain", "fsdp1_blocks", "fsdp1_lora_orig", "fsdp2")
WRAPPINGS = ("plain", "fsdp1_blocks", "fsdp1_lora_orig", "fsdp1_lora_flat", "fsdp2")
STATES = ("fresh", "stepped")
ADAPTER_CASES = {  # name: (adapters the model has, adapter asked for)
    "default": (("default",), "default"),
    "policy": (("policy",), "policy"),
    "two_ask_default": (("default", "policy"), "default"),
    "two_ask_policy": (("default", "policy"), "policy"),
}
LAYERED_BASE_ERROR = ["ValueError", "layered_summon", "base_sync_done"]
# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): name -> (world, fully_shard options)
MP_WRAPPINGS = {
    "fsdp2_mp": (WORLD, {}),  # default: the root stays unsharded after forward, the blocks not
    "fsdp2_mp_keep": (WORLD, {"reshard_after_forward": False}),  # every unit stays unsharded
    "fsdp2_mp_offload": (WORLD, {"offload": True}),  # CPUOffloadPolicy
    "hsdp_mp": (WORLD4, {"mesh_shape": (2, 2)}),  # HSDP: replicate over 2, shard over 2
    "hsdp_mp_offload_keep": (WORLD4, {"mesh_shape": (2, 2), "offload": True, "reshard_after_forward": False}),
    "fsdp2x4_mp_reshard2": (WORLD4, {"reshard_after_forward": 2}),  # bf16 shards on 2 ranks after forward
}
# fresh; forward+backward; a step then a no_grad forward; a forward whose backward comes after
MP_STATES = ("fresh", "fwd_bwd", "nograd_fwd", "grad_fwd")
MP_SUMMON_WRAPPINGS = ("fsdp2_mp", "hsdp_mp_offload_keep", "fsdp2x4_mp_reshard2")
MP_SUMMONS = ("summon", "summon_writeback", "summon_with_grads")


def _cell_specs() -> dict[str, list[str] | None]:
    """Every distributed cell id -> the error substrings it must raise (None: must succeed)."""
    cells: dict[str, list[str] | None] = {}
    for w in WRAPPINGS:
        for state in STATES:
            for case in ADAPTER_CASES:
                for layered in (False, True):
                    for synced in (False, True):
                        error = LAYERED_BASE_ERROR if layered and not synced else None
                        cells[_matrix_id(w, state, case, layered, synced)] = error
            cells[f"{w}-{state}-missing_adapter"] = ["ValueError", "'nope'", "default", "policy"]
        cells[f"{w}-wrong_prefix"] = ["ValueError", "blocks.", "['transformer_blocks']"]
        cells[f"{w}-absent_second_prefix"] = ["ValueError", "single_transformer_blocks.", "['transformer_blocks']"]
        cells[f"{w}-flux_two_prefixes_lora"] = None
        cells[f"{w}-flux_base"] = None
        cells[f"{w}-qwen_image_lora"] = None
        cells[f"{w}-qwen_image_base"] = None
        if w in WAN_WRAPPINGS:
            cells[f"{w}-wan_lora"] = None
            cells[f"{w}-wan_base"] = None
        cells[f"{w}-diffusers_load_lora_adapter"] = None
        cells[f"{w}-layered_gathering"] = None
        cells[f"{w}-summon"] = None
        cells[f"{w}-summon_writeback"] = None
        flat = w == "fsdp1_lora_flat"  # FSDP1 only offers with_grads with use_orig_params=True
        cells[f"{w}-summon_with_grads"] = ["use_orig_params"] if flat else None
    cells["fsdp2-wan_worker_sync"] = None
    for w in MP_WRAPPINGS:
        for state in MP_STATES:
            cells[f"{w}-{state}"] = None
    for w in MP_SUMMON_WRAPPINGS:
        for summon in MP_SUMMONS:
            cells[f"{w}-{summon}"] = None
    return cells


def _cell_world(cell: str) -> int:
    wrapping = cell.split("-", 1)[0]
    return MP_WRAPPINGS[wrapping][0] if wrapping in MP_WRAPPINGS else WORLD


def _matrix_id(wrapping, state, case, layered, synced) -> str:
    """`synced` is base_sync_done: LoRA-only collection."""
    return f"{wrapping}-{state}-{case}-{'layered' if layered else 'full'}-{'lora' if synced else 'base'}"


CELLS = _cell_specs()


# ---------------------------------------------------------------------------------------
# Models, inputs, wrapping, training
# ---------------------------------------------------------------------------------------


def _lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: random lora_B too, so LoRA values change the outputs
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)


def _build_sd3(seed=0):
    from omni.models.sd3 import build_tiny_transformer

    return build_tiny_transformer(seed=seed)


def _build_flux(seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    )  # fmt: skip


def _build_qwen_image(seed=0):
    from diffusers import QwenImageTransformer2DModel

    from omni.models.qwen_image import TINY_TRANSFORMER

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**TINY_TRANSFORMER)


def _build_wan(seed=0):
    from diffusers import WanTransformer3DModel

    from omni.models.wan import TINY_TRANSFORMER

    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY_TRANSFORMER)


BUILDERS = {"sd3": _build_sd3, "flux": _build_flux, "qwen_image": _build_qwen_image, "wan": _build_wan}


def _with_adapters(kind, adapters, lora_seed=1, base_seed=0):
    model = BUILDERS[kind](base_seed)
    torch.manual_seed(lora_seed)
    for name in adapters:
        model.add_adapter(_lora_config(), adapter_name=name)
    return model


def _inputs(model):
    g = torch.Generator().manual_seed(7)
    if any("single_transformer_blocks" in n for n, _ in model.named_modules()):  # FLUX, maybe wrapped
        return dict(
            hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
            pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
            img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), return_dict=False,
        )  # fmt: skip
    if any(n.endswith("img_mlp") for n, _ in model.named_modules()):  # Qwen-Image: a 4x4 grid of packed tokens
        from omni.models.qwen_image import TINY_TRANSFORMER

        text = torch.randn(1, 5, TINY_TRANSFORMER["joint_attention_dim"], generator=g)
        return dict(
            hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=text,
            encoder_hidden_states_mask=torch.ones(1, 5), timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )  # fmt: skip
    if any(n.endswith("patch_embedding") for n, _ in model.named_modules()):  # Wan: a 2-frame 4x4 video latent
        from omni.models.wan import TINY_TRANSFORMER

        return dict(
            hidden_states=torch.randn(1, 16, 2, 4, 4, generator=g),
            encoder_hidden_states=torch.randn(1, 5, TINY_TRANSFORMER["text_dim"], generator=g),
            timestep=torch.tensor([500.0]), return_dict=False,
        )  # fmt: skip
    return dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(1, 6, 64, generator=g),
        pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([3.0]), return_dict=False,
    )  # fmt: skip


def _output(model):
    with torch.no_grad():
        return model(**_inputs(model))[0]


def _backward(model):
    model(**_inputs(model))[0].pow(2).mean().backward()


def _train_step(model):
    """One AdamW step on the same batch on every rank."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _backward(model)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _block_classes(model):
    return {type(m) for n, m in model.named_modules() if n.split(".")[-1].isdigit() and "blocks" in n.split(".")[-2]}


def _trainable_leaf(m: nn.Module) -> bool:
    return not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))


def _wrap(model, wrapping):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    blocks = tuple(_block_classes(model))
    cpu = torch.device("cpu")
    if wrapping == "plain":
        return model
    if wrapping == "fsdp1_blocks":  # blocks mix frozen base and trainable LoRA: needs orig params
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(set(blocks)), use_orig_params=True, device_id=cpu)
    if wrapping in ("fsdp1_lora_orig", "fsdp1_lora_flat"):
        policy = CustomPolicy(lambda m: isinstance(m, blocks) or _trainable_leaf(m))
        orig = wrapping == "fsdp1_lora_orig"
        return FSDP(model, auto_wrap_policy=policy, use_orig_params=orig, device_id=cpu)
    return _fully_shard(model)


def _fully_shard(model, mesh_shape=None, offload=False, reshard_after_forward=None, bf16=False):
    """FSDP2 over the blocks, then the root; a 2-D `mesh_shape` is HSDP (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh_shape = mesh_shape or (torch.distributed.get_world_size(),)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    options = {"mesh": init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)}
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    blocks = tuple(_block_classes(model))
    for m in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(m, **options)
    return fully_shard(model, **options)


# ---------------------------------------------------------------------------------------
# Checks (run inside the workers; each returns a list of problems)
# ---------------------------------------------------------------------------------------


def _storage_ptrs(model) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors}


def _tensor_problems(key, t, model_ptrs) -> list[str]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return [f"{key}: DTensor"]
    problems = []
    if t.device.type != "cpu":
        problems.append(f"{key}: on {t.device}")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        problems.append(f"{key}: does not own its storage ({t.untyped_storage().nbytes()} bytes for {tuple(t.shape)})")
    if t.untyped_storage().data_ptr() in model_ptrs:
        problems.append(f"{key}: aliases a model tensor")
    return problems


def _compare(got: dict, expected: dict, model) -> list[str]:
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    problems = [f"missing keys {missing[:5]} ({len(missing)})"] if missing else []
    problems += [f"unexpected keys {extra[:5]} ({len(extra)})"] if extra else []
    ptrs = _storage_ptrs(model)
    for key in sorted(got.keys() & expected.keys()):
        problems += _tensor_problems(key, got[key], ptrs)
        try:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            problems.append(f"{key}: value differs: {str(e).splitlines()[-1]}")
    return problems


def _output_problem(what, got, expected) -> list[str]:
    try:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        return []
    except AssertionError as e:
        return [f"{what}: outputs differ: {str(e).splitlines()[-1]}"]


def _base_roundtrip(kind, got) -> list[str]:
    fresh = BUILDERS[kind](seed=123)
    try:
        fresh.load_state_dict(got, strict=True)
    except RuntimeError as e:
        return [f"base load_state_dict(strict=True): {str(e)[:300]}"]
    return _output_problem("base round trip", _output(fresh), _output(BUILDERS[kind](seed=0)))


def _lora_roundtrip(kind, got, ref, asked) -> list[str]:
    from peft import set_peft_model_state_dict

    fresh = _with_adapters(kind, (asked,), lora_seed=999)
    result = set_peft_model_state_dict(fresh, got, adapter_name=asked)
    if result.unexpected_keys:
        return [f"LoRA round trip: unexpected keys {result.unexpected_keys[:5]}"]
    ref.set_adapter(asked)
    return _output_problem("LoRA round trip", _output(fresh), _output(ref))


def _digests(state: dict) -> dict[str, str]:
    as_bytes = {k: t.reshape(-1).contiguous().view(torch.uint8).numpy() for k, t in state.items()}  # numpy: no bf16
    return {k: hashlib.sha1(b.tobytes()).hexdigest() for k, b in as_bytes.items()}


def _record(fn) -> dict:
    """Run one cell; a raised exception becomes the cell's `error`."""
    try:
        problems, digests = fn()
    except Exception as e:  # noqa: BLE001 - reported per cell, asserted by the parent
        return {"error": f"{type(e).__name__}: {e}", "problems": [], "digests": {}}
    return {"error": None, "problems": problems, "digests": digests}


def _collect_cell(kind, model, ref, layered, synced, asked, prefixes):
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params

    got = collect_lora_params(model, layered, synced, adapter_name=asked, layer_prefixes=prefixes)
    if synced:
        expected = get_peft_model_state_dict(ref, adapter_name=asked)
        problems = _compare(got, expected, model) + _lora_roundtrip(kind, got, ref, asked)
    else:
        problems = _compare(got, BUILDERS[kind](seed=0).state_dict(), model) + _base_roundtrip(kind, got)
    return problems, _digests(got)


# ---------------------------------------------------------------------------------------
# Cell groups per wrapping
# ---------------------------------------------------------------------------------------


def _matrix_cells(w) -> dict:
    out = {}
    for state in STATES:
        for adapters in dict.fromkeys(a for a, _ in ADAPTER_CASES.values()):
            model, ref = _wrap(_with_adapters("sd3", adapters), w), _with_adapters("sd3", adapters)
            if state == "stepped":
                _train_step(model)
                _train_step(ref)
            for case, (case_adapters, asked) in ADAPTER_CASES.items():
                if case_adapters != adapters:
                    continue
                for layered in (False, True):
                    for synced in (False, True):
                        cell = functools.partial(_collect_cell, "sd3", model, ref, layered, synced, asked, SD3_PREFIXES)
                        out[_matrix_id(w, state, case, layered, synced)] = _record(cell)
            if len(adapters) == 2:
                out[f"{w}-{state}-missing_adapter"] = _record(
                    functools.partial(_collect_cell, "sd3", model, ref, True, True, "nope", SD3_PREFIXES)
                )
    return out


def _prefix_cells(w) -> dict:
    model, ref = _wrap(_with_adapters("sd3", ("default",)), w), _with_adapters("sd3", ("default",))
    flux, flux_ref = _wrap(_with_adapters("flux", ("default",)), w), _with_adapters("flux", ("default",))
    qwen, qwen_ref = _wrap(_with_adapters("qwen_image", ("default",)), w), _with_adapters("qwen_image", ("default",))
    for trained in (flux, flux_ref, qwen, qwen_ref):
        _train_step(trained)
    both = ("transformer_blocks.", "single_transformer_blocks.")
    return {
        f"{w}-wrong_prefix": _record(lambda: _collect_cell("sd3", model, ref, True, True, "default", ("blocks.",))),
        f"{w}-absent_second_prefix": _record(lambda: _collect_cell("sd3", model, ref, True, True, "default", both)),
        f"{w}-flux_two_prefixes_lora": _record(
            lambda: _collect_cell("flux", flux, flux_ref, True, True, "default", FLUX_PREFIXES)
        ),
        f"{w}-flux_base": _record(
            lambda: _collect_cell("flux", flux, flux_ref, False, False, "default", FLUX_PREFIXES)
        ),
        f"{w}-qwen_image_lora": _record(
            lambda: _collect_cell("qwen_image", qwen, qwen_ref, True, True, "default", SD3_PREFIXES)
        ),
        f"{w}-qwen_image_base": _record(
            lambda: _collect_cell("qwen_image", qwen, qwen_ref, False, False, "default", SD3_PREFIXES)
        ),
        **_wan_cells(w),
    }


def _wan_cells(w) -> dict:
    """Wan's 5-D video transformer after a step: LoRA (layered) and base weights collected exactly."""
    if w not in WAN_WRAPPINGS:
        return {}
    wan, wan_ref = _wrap(_with_adapters("wan", ("default",)), w), _with_adapters("wan", ("default",))
    _train_step(wan)
    _train_step(wan_ref)
    return {
        f"{w}-wan_lora": _record(lambda: _collect_cell("wan", wan, wan_ref, True, True, "default", WAN_PREFIXES)),
        f"{w}-wan_base": _record(lambda: _collect_cell("wan", wan, wan_ref, False, False, "default", WAN_PREFIXES)),
    }


def _wan_worker_cell(wan_dir: str, run_dir: str):
    """A real ActorRolloutWorker on the tiny Wan in this group (the actor under FSDP2 over the
    ranks, the engine its own copy): after a Flow-GRPO step and the LoRA sync, the actor
    re-scores the engine's new clips' SDE transitions to 1e-5; before the sync the engine's
    log-probs are stale (the step moved the actor, so agreement is not trivial)."""
    from omni.algorithms import flow_grpo
    from omni.validation import validate
    from omni.workers.actor_rollout import ActorRolloutWorker
    from tests.conftest import compose_config, training_options
    from tests.workers.test_actor_rollout import rescore

    overrides = [
        f"model.cache_dir={os.path.dirname(wan_dir)}",
        "model=wan_tiny",
        "reward=frame_brightness",
        "model.fsdp.version=2",
        "rollout.share_actor=false",
        "rollout.num_steps=4",
        "trainer.device=cpu",
    ]
    cfg = validate(compose_config(overrides, run_dir))
    worker = ActorRolloutWorker(cfg, wan_dir, torch.distributed.get_rank(), torch.distributed.get_world_size())
    worker.setup()  # joins this process group
    try:
        prompts, seeds, options = ["a red cat", "a blue dog"] * 2, list(range(4)), training_options(cfg, 0)
        batch = worker.generate(prompts, seeds, options)
        worker.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, torch.tensor([1.0, -1.0, 0.5, -0.5])), seed=0)
        stale, stale_engine, _ = rescore(worker, batch, with_reference=False)
        worker.sync_weights()
        actor, engine, _ = rescore(worker, worker.generate(prompts, seeds, options), with_reference=False)
        lora = worker.lora_state_dict()
    finally:
        worker.engine.shutdown()  # not worker.shutdown(): the group is this module's
    problems = (
        [] if all(hasattr(p, "to_local") for p in worker.trainable) else ["the actor's LoRA is not FSDP2-sharded"]
    )
    if (stale - stale_engine).abs().max() < 1e-3:
        problems.append("the step did not move the actor's log-probs")
    if len(actor) == 0 or (actor - engine).abs().max() > 1e-5:
        problems.append(f"actor and engine log-probs differ by {float((actor - engine).abs().max())} after the sync")
    return problems, _digests({"actor_log_probs": actor, **lora})


def _diffusers_loader_cell(w):
    """Layered LoRA of a trained non-default adapter, loaded by diffusers' own loader."""
    from omni.fsdp_utils import collect_lora_params

    model, ref = _wrap(_with_adapters("sd3", ("policy",)), w), _with_adapters("sd3", ("policy",))
    _train_step(model)
    _train_step(ref)
    got = collect_lora_params(model, True, True, is_diffusers=True, adapter_name="policy")
    fresh = _build_sd3(0)
    metadata = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS}
    fresh.load_lora_adapter(got, prefix=None, adapter_name="policy", metadata=metadata)
    return _output_problem("load_lora_adapter", _output(fresh), _output(ref)), _digests(got)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _full_params(model) -> dict:
    return {_clean(n): p for n, p in model.named_parameters() if not n.endswith("_flat_param")}


def _summon_cell(w):
    """Whole, exact parameters inside; sharded again after."""
    from torch.distributed.tensor import DTensor

    from omni.fsdp_utils import fsdp_summon_full_params

    model, ref = _wrap(_with_adapters("sd3", ("default",)), w), _with_adapters("sd3", ("default",))
    _train_step(model)
    _train_step(ref)
    with fsdp_summon_full_params(model):
        inside = {k: p.detach().clone() for k, p in _full_params(model).items()}
        dtensors = [k for k, p in _full_params(model).items() if isinstance(p, DTensor)]
    problems = [f"DTensors inside the context: {dtensors[:3]}"] if dtensors else []
    problems += _compare(inside, dict(ref.named_parameters()), model)
    after = list(model.parameters())
    full_numel = sum(p.numel() for p in ref.parameters())
    if w == "fsdp2" and not all(isinstance(p, DTensor) for p in after):
        problems.append("FSDP2 parameters not resharded after the context")
    if w.startswith("fsdp1") and sum(p.numel() for p in after) >= full_numel:
        problems.append("FSDP1 parameters not resharded after the context")
    return problems, _digests(inside)


def _summon_writeback_cell(w):
    """Changes made inside a writeback context reach the shards (LoRA and base)."""
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params, fsdp_summon_full_params

    model, ref = _wrap(_with_adapters("sd3", ("default",)), w), _with_adapters("sd3", ("default",))
    lora_key, base_key = "transformer_blocks.0.attn.to_q.lora_B.default.weight", "proj_out.base_layer.weight"
    with fsdp_summon_full_params(model, writeback=True):
        with torch.no_grad():
            for key in (lora_key, base_key):
                _full_params(model)[key].add_(1.0)
    with torch.no_grad():
        for key in (lora_key, base_key):
            dict(ref.named_parameters())[key].add_(1.0)
    got = collect_lora_params(model, False, True)
    problems = _compare(got, get_peft_model_state_dict(ref), model)
    base = collect_lora_params(model, False, False)
    expected_base = _build_sd3(0).state_dict()
    expected_base["proj_out.weight"] = expected_base["proj_out.weight"] + 1.0
    return problems + _compare(base, expected_base, model), _digests(got)


def _summon_grads_cell(w):
    """with_grads shows the whole (rank-averaged) gradients."""
    from omni.fsdp_utils import fsdp_summon_full_params

    model, ref = _wrap(_with_adapters("sd3", ("default",)), w), _with_adapters("sd3", ("default",))
    _backward(model)
    _backward(ref)
    with fsdp_summon_full_params(model, with_grads=True):
        grads = {k: p.grad.clone() for k, p in _full_params(model).items() if p.grad is not None}
    expected = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    # FSDP1 shows a zero gradient for frozen parameters sharing a flat parameter with trainable ones
    extra = {k: g for k, g in grads.items() if k not in expected}
    problems = [f"non-zero gradient on frozen {k}" for k, g in extra.items() if g.any()]
    grads = {k: g for k, g in grads.items() if k in expected}
    return problems + _compare(grads, expected, model), _digests(grads)


def _gathering_cell(w):
    """Layered LoRA sync: FSDP1 holds one unit gathered at a time (with a LoRA-aware wrap
    only LoRA units), FSDP2 all-gathers only the LoRA tensors."""
    from contextlib import contextmanager
    from unittest import mock

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    from omni.fsdp_utils import collect_lora_params

    model = _wrap(_with_adapters("sd3", ("default",)), w)
    _train_step(model)
    summon, full_tensor = FSDP.summon_full_params, DTensor.full_tensor
    depth, max_depth, summoned, gathered = [0], [0], set(), []

    @contextmanager
    def counting_summon(module, *args, **kwargs):
        with summon(module, *args, **kwargs):
            depth[0] += 1
            max_depth[0] = max(max_depth[0], depth[0])
            summoned.add(type(module._fsdp_wrapped_module).__name__)
            yield
            depth[0] -= 1

    def counting_full_tensor(self, *args, **kwargs):
        gathered.append(self.numel())
        return full_tensor(self, *args, **kwargs)

    with mock.patch.object(FSDP, "summon_full_params", staticmethod(counting_summon)):
        with mock.patch.object(DTensor, "full_tensor", counting_full_tensor):
            got = collect_lora_params(model, True, True)
    problems = [f"{max_depth[0]} FSDP1 units gathered at once"] if max_depth[0] > 1 else []
    if w.startswith("fsdp1_lora") and summoned - {"Linear"}:
        problems.append(f"LoRA-aware wrap: gathered units wrapping {sorted(summoned)}")
    if len(gathered) not in (0, len(got)) or sum(gathered) > sum(t.numel() for t in got.values()):
        problems.append(f"FSDP2 all-gathered {len(gathered)} tensors ({sum(gathered)} elements) for {len(got)} LoRA")
    if w == "fsdp2" and not gathered:
        problems.append("FSDP2: nothing all-gathered")
    return problems, _digests(got)


# ---------------------------------------------------------------------------------------
# FSDP2 mixed precision: fp32 masters whatever FSDP2 has registered on the modules
# ---------------------------------------------------------------------------------------


def _mp_model(w):
    return _fully_shard(_with_adapters("sd3", ("default",)), bf16=True, **MP_WRAPPINGS[w][1])


def _registered(model) -> list:
    """Which tensor each parameter slot holds: FSDP2 swaps sharded and unsharded ones in."""
    return [(n, id(p), p.dtype) for n, p in model.named_parameters()]


def _fsdp2_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _masters(model) -> dict:
    """Whole copies of the fp32 master parameters, read while every parameter is sharded."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    unsharded = [n for n, p in params.items() if not isinstance(p, DTensor)]
    assert not unsharded, f"test precondition: {unsharded[:3]} not sharded"
    masters = {n: p.detach().full_tensor() for n, p in params.items()}
    assert {m.dtype for m in masters.values()} == {torch.float32}
    return masters


def _masters_reference(masters: dict):
    """An unwrapped model holding `masters` (names are unchanged by FSDP2)."""
    ref = _with_adapters("sd3", ("default",))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(masters[n])
    return ref


def _bring_to_state(model, state):
    """Put `model` in `state`; returns (the masters, a pending forward output or None)."""
    if state == "fresh":
        return _masters(model), None
    if state == "fwd_bwd":
        _backward(model)
        return _masters(model), None
    if state == "nograd_fwd":  # a log-prob or validation pass after an update
        _train_step(model)
        masters = _masters(model)
        _output(model)
        return masters, None
    masters = _masters(model)  # grad_fwd: a forward, its backward after the collection
    return masters, model(**_inputs(model))[0]


def _mp_collect_cell(w, state):
    """LoRA (whole and layered) and base: the fp32 masters; the module untouched (the same
    tensors registered, a second collection identical, backward and forward still work)."""
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params

    model = _mp_model(w)
    masters, pending = _bring_to_state(model, state)
    ref = _masters_reference(masters)
    registered = _registered(model)
    expected_lora, expected_base = get_peft_model_state_dict(ref), _build_sd3(0).state_dict()
    problems, collected = [], {}
    for what, layered, synced in (("lora", False, True), ("lora_layered", True, True), ("base", False, False)):
        collected[what] = got = collect_lora_params(model, layered, synced)
        problems += [f"{what}: {p}" for p in _compare(got, expected_lora if synced else expected_base, model)]
    if _registered(model) != registered:
        problems.append("the collection changed the tensors registered on the module")
    if _digests(collect_lora_params(model, True, True)) != _digests(collected["lora"]):
        problems.append("a second collection differs from the first")
    (pending if pending is not None else model(**_inputs(model))[0]).pow(2).mean().backward()
    _output(model)  # and a no_grad forward after it
    again = collect_lora_params(model, False, True)
    problems += [f"after backward and a no_grad forward: {p}" for p in _compare(again, expected_lora, model)]
    return problems, {**_digests(collected["lora"]), **_digests(collected["base"])}


def _mp_summon_cell(w):
    """After a step and a no_grad forward: whole fp32 masters inside; the same tensors
    registered after (unsharded compute copies stay), and training goes on."""
    from torch.distributed.tensor import DTensor

    from omni.fsdp_utils import fsdp_summon_full_params

    model = _mp_model(w)
    masters, _ = _bring_to_state(model, "nograd_fwd")
    registered = _registered(model)
    with fsdp_summon_full_params(model):
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        dtensors = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    problems = [f"DTensors inside the context: {dtensors[:3]}"] if dtensors else []
    problems += _compare(inside, masters, model)
    if _registered(model) != registered:
        problems.append("the summon did not restore the tensors registered on the module")
    _train_step(model)
    return problems, _digests(inside)


def _mp_summon_writeback_cell(w):
    """After a step and a no_grad forward, +1 written back to a block's LoRA, a block's
    base and a root-level base weight: exactly that reaches the fp32 masters (the rest
    untouched, not rounded to bf16), and the unsharded compute copies see it too."""
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params, fsdp_summon_full_params

    model = _mp_model(w)
    masters, _ = _bring_to_state(model, "nograd_fwd")
    registered = _registered(model)
    keys = (
        "transformer_blocks.0.attn.to_q.lora_B.default.weight",
        "transformer_blocks.1.attn.to_k.base_layer.weight",
        "proj_out.base_layer.weight",
    )
    with fsdp_summon_full_params(model, writeback=True):
        with torch.no_grad():
            for key in keys:
                dict(model.named_parameters())[key].add_(1.0)
    for key in keys:
        masters[key] = masters[key] + 1.0
    problems = []
    if _registered(model) != registered:
        problems.append("the summon did not restore the tensors registered on the module")
    ref = _masters_reference(masters)
    got = collect_lora_params(model, False, True)
    problems += _compare(got, get_peft_model_state_dict(ref), model)
    expected_base = _build_sd3(0).state_dict()
    for key in ("transformer_blocks.1.attn.to_k.weight", "proj_out.weight"):
        expected_base[key] = expected_base[key] + 1.0
    problems += _compare(collect_lora_params(model, False, False), expected_base, model)
    as_registered = _output(model)  # with whatever compute copies the module holds
    for m in _fsdp2_modules(model):
        m.reshard()
    problems += _output_problem("compute copies after writeback", as_registered, _output(model))
    return problems, _digests(got)


def _mp_summon_grads_cell(w):
    """After forward+backward and a no_grad forward: the fp32 gradients of every
    parameter that has one, whole."""
    from omni.fsdp_utils import fsdp_summon_full_params

    model = _mp_model(w)
    _backward(model)
    expected = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    _output(model)  # leaves the root unsharded, its gradients on the sharded parameters
    with fsdp_summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    problems = [] if expected else ["test precondition: no gradients"]
    return problems + _compare(grads, expected, model), _digests(grads)


def _mp_cells(world) -> dict:
    out = {}
    for w, (w_world, _) in MP_WRAPPINGS.items():
        if w_world != world:
            continue
        for state in MP_STATES:
            out[f"{w}-{state}"] = _record(functools.partial(_mp_collect_cell, w, state))
        if w in MP_SUMMON_WRAPPINGS:
            out[f"{w}-summon"] = _record(functools.partial(_mp_summon_cell, w))
            out[f"{w}-summon_writeback"] = _record(functools.partial(_mp_summon_writeback_cell, w))
            out[f"{w}-summon_with_grads"] = _record(functools.partial(_mp_summon_grads_cell, w))
        torch.distributed.barrier()
    return out


def _wrapping_cells(w) -> dict:
    out = _matrix_cells(w)
    out.update(_prefix_cells(w))
    out[f"{w}-diffusers_load_lora_adapter"] = _record(lambda: _diffusers_loader_cell(w))
    out[f"{w}-layered_gathering"] = _record(lambda: _gathering_cell(w))
    out[f"{w}-summon"] = _record(lambda: _summon_cell(w))
    out[f"{w}-summon_writeback"] = _record(lambda: _summon_writeback_cell(w))
    out[f"{w}-summon_with_grads"] = _record(lambda: _summon_grads_cell(w))
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, wan_dir: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        results = {}
        for w in WRAPPINGS if world == WORLD else ():
            results.update(_wrapping_cells(w))
            dist.barrier()
        if world == WORLD:
            results["fsdp2-wan_worker_sync"] = _record(lambda: _wan_worker_cell(wan_dir, out_dir))
        results.update(_mp_cells(world))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------


# What every worker imports, imported once by the forkserver that forks them (instead of
# in each spawned process: peft alone takes seconds, 4 processes share 2 cores here).
_WORKER_PRELOAD = [
    __name__,
    *cli_process.PRELOAD,  # the server is shared with tests/cli_process.py's runs: their imports too
    "omni.fsdp_utils",
    "omni.models.sd3",
    "torch.distributed.fsdp",
    "diffusers.models.transformers.transformer_sd3",
    "diffusers.models.transformers.transformer_flux",
    "diffusers.models.transformers.transformer_wan",
    "omni.workers.actor_rollout",
    "omni.algorithms.flow_grpo",
    "tests.conftest",
]


def _run_group(world: int, out_dir, wan_dir) -> list[dict]:
    import multiprocessing

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the forkserver, started on first use
    multiprocessing.get_context("forkserver").set_forkserver_preload(_WORKER_PRELOAD)
    try:
        torch.multiprocessing.start_processes(
            _worker,
            args=(world, free_port(), str(out_dir), str(wan_dir)),
            nprocs=world,
            start_method="forkserver",
            join=True,
        )
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_wan_dir):
    """world size -> each rank's cell results; each group is started once, when first needed."""
    groups: dict[int, list[dict]] = {}

    def of_world(world: int) -> list[dict]:
        if world not in groups:
            groups[world] = _run_group(world, tmp_path_factory.mktemp(f"fsdp_cells_{world}"), tiny_wan_dir)
        return groups[world]

    return of_world


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell(results, cell):
    expect_error = CELLS[cell]
    per_rank = [r[cell] for r in results(_cell_world(cell))]
    for rank, r in enumerate(per_rank):
        if expect_error:
            assert r["error"], f"rank {rank}: expected an error containing {expect_error}, got none"
            assert all(s in r["error"] for s in expect_error), f"rank {rank}: {r['error']!r} lacks {expect_error}"
        else:
            assert r["error"] is None, f"rank {rank}: {r['error']}"
            assert r["problems"] == [], f"rank {rank}: " + "\n".join(r["problems"])
    assert all(r["digests"] == per_rank[0]["digests"] for r in per_rank), "ranks returned different tensors"


def test_layered_summon_needs_base_sync_done_plain():
    from omni.fsdp_utils import collect_lora_params

    with pytest.raises(ValueError, match="base_sync_done"):
        collect_lora_params(_with_adapters("sd3", ("default",)), layered_summon=True, base_sync_done=False)


def test_peft_inject_adapter_in_model_layout():
    """peft's own injection (no diffusers add_adapter, no peft_config on the model)."""
    from peft import inject_adapter_in_model

    from omni.fsdp_utils import collect_lora_params

    model = inject_adapter_in_model(_lora_config(), _build_sd3(0), adapter_name="policy")
    got = collect_lora_params(model, layered_summon=True, base_sync_done=True, adapter_name="policy")
    expected = {n.replace(".policy.", "."): p for n, p in model.named_parameters() if ".lora_" in n}
    assert got.keys() == expected.keys() and "proj_out.lora_B.weight" in got
    assert all(torch.equal(got[k], expected[k]) for k in got)
    base = collect_lora_params(model, layered_summon=False, base_sync_done=False)
    _build_sd3(5).load_state_dict(base, strict=True)


def test_collecting_nothing_is_an_error():
    from omni.fsdp_utils import collect_lora_params

    with pytest.raises(ValueError, match=r"collected no base tensors.*adapter_name='default'.*transformer_blocks"):
        collect_lora_params(nn.Module(), layered_summon=False, base_sync_done=False)


def test_state_nbytes_counts_bytes():
    from omni.fsdp_utils import state_nbytes

    assert state_nbytes({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float16)}) == 3 * 4 * 4 + 5 * 2


def test_summon_on_plain_module_is_a_no_op():
    from omni.fsdp_utils import fsdp_summon_full_params

    model = nn.Linear(3, 2)
    weight = model.weight
    with fsdp_summon_full_params(model, writeback=True, with_grads=True):
        assert model.weight is weight
