"""The distributed cells of tests/test_fsdp_utils.py, run inside each rank of a gloo group.

`CELLS` names every cell and the error it must raise (None: it must succeed); `worker` runs a
rank's share of them and writes each cell's problems, error and tensor digests to a JSON file
that the tests read. The cells: every wrapping x adapter case x {fresh, after an AdamW step} x
layered x base_sync_done collection, the prefix and family cells (FLUX, Qwen-Image, Wan), the
summon cells, a whole ActorRolloutWorker on the tiny Wan, and FSDP2 mixed precision (bf16
compute, fp32 masters) in the states where FSDP2 leaves compute copies registered.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from datetime import timedelta

import torch

from tests.fsdp_models import (
    BUILDERS,
    TARGETS,
    backward,
    base_roundtrip,
    build_sd3,
    compare,
    digests,
    fully_shard,
    inputs,
    lora_roundtrip,
    output,
    output_problem,
    record,
    train_step,
    with_adapters,
    wrap,
)

WORLD = 2
WORLD4 = 4  # HSDP (2 x 2 mesh) and partial post-forward resharding need 4 ranks
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


def cell_world(cell: str) -> int:
    wrapping = cell.split("-", 1)[0]
    return MP_WRAPPINGS[wrapping][0] if wrapping in MP_WRAPPINGS else WORLD


def _matrix_id(wrapping, state, case, layered, synced) -> str:
    """`synced` is base_sync_done: LoRA-only collection."""
    return f"{wrapping}-{state}-{case}-{'layered' if layered else 'full'}-{'lora' if synced else 'base'}"


CELLS = _cell_specs()


def _collect_cell(kind, model, ref, layered, synced, asked, prefixes):
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params

    got = collect_lora_params(model, layered, synced, adapter_name=asked, layer_prefixes=prefixes)
    if synced:
        expected = get_peft_model_state_dict(ref, adapter_name=asked)
        problems = compare(got, expected, model) + lora_roundtrip(kind, got, ref, asked)
    else:
        problems = compare(got, BUILDERS[kind](seed=0).state_dict(), model) + base_roundtrip(kind, got)
    return problems, digests(got)


# ---------------------------------------------------------------------------------------
# Cell groups per wrapping
# ---------------------------------------------------------------------------------------


def _matrix_cells(w) -> dict:
    out = {}
    for state in STATES:
        for adapters in dict.fromkeys(a for a, _ in ADAPTER_CASES.values()):
            model, ref = wrap(with_adapters("sd3", adapters), w), with_adapters("sd3", adapters)
            if state == "stepped":
                train_step(model)
                train_step(ref)
            for case, (case_adapters, asked) in ADAPTER_CASES.items():
                if case_adapters != adapters:
                    continue
                for layered in (False, True):
                    for synced in (False, True):
                        cell = functools.partial(_collect_cell, "sd3", model, ref, layered, synced, asked, SD3_PREFIXES)
                        out[_matrix_id(w, state, case, layered, synced)] = record(cell)
            if len(adapters) == 2:
                out[f"{w}-{state}-missing_adapter"] = record(
                    functools.partial(_collect_cell, "sd3", model, ref, True, True, "nope", SD3_PREFIXES)
                )
    return out


def _prefix_cells(w) -> dict:
    model, ref = wrap(with_adapters("sd3", ("default",)), w), with_adapters("sd3", ("default",))
    flux, flux_ref = wrap(with_adapters("flux", ("default",)), w), with_adapters("flux", ("default",))
    qwen, qwen_ref = wrap(with_adapters("qwen_image", ("default",)), w), with_adapters("qwen_image", ("default",))
    for trained in (flux, flux_ref, qwen, qwen_ref):
        train_step(trained)
    both = ("transformer_blocks.", "single_transformer_blocks.")
    return {
        f"{w}-wrong_prefix": record(lambda: _collect_cell("sd3", model, ref, True, True, "default", ("blocks.",))),
        f"{w}-absent_second_prefix": record(lambda: _collect_cell("sd3", model, ref, True, True, "default", both)),
        f"{w}-flux_two_prefixes_lora": record(
            lambda: _collect_cell("flux", flux, flux_ref, True, True, "default", FLUX_PREFIXES)
        ),
        f"{w}-flux_base": record(lambda: _collect_cell("flux", flux, flux_ref, False, False, "default", FLUX_PREFIXES)),
        f"{w}-qwen_image_lora": record(
            lambda: _collect_cell("qwen_image", qwen, qwen_ref, True, True, "default", SD3_PREFIXES)
        ),
        f"{w}-qwen_image_base": record(
            lambda: _collect_cell("qwen_image", qwen, qwen_ref, False, False, "default", SD3_PREFIXES)
        ),
        **_wan_cells(w),
    }


def _wan_cells(w) -> dict:
    """Wan's 5-D video transformer after a step: LoRA (layered) and base weights collected exactly."""
    if w not in WAN_WRAPPINGS:
        return {}
    wan, wan_ref = wrap(with_adapters("wan", ("default",)), w), with_adapters("wan", ("default",))
    train_step(wan)
    train_step(wan_ref)
    return {
        f"{w}-wan_lora": record(lambda: _collect_cell("wan", wan, wan_ref, True, True, "default", WAN_PREFIXES)),
        f"{w}-wan_base": record(lambda: _collect_cell("wan", wan, wan_ref, False, False, "default", WAN_PREFIXES)),
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
    return problems, digests({"actor_log_probs": actor, **lora})


def _diffusers_loader_cell(w):
    """Layered LoRA of a trained non-default adapter, loaded by diffusers' own loader."""
    from omni.fsdp_utils import collect_lora_params

    model, ref = wrap(with_adapters("sd3", ("policy",)), w), with_adapters("sd3", ("policy",))
    train_step(model)
    train_step(ref)
    got = collect_lora_params(model, True, True, is_diffusers=True, adapter_name="policy")
    fresh = build_sd3(0)
    metadata = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS}
    fresh.load_lora_adapter(got, prefix=None, adapter_name="policy", metadata=metadata)
    return output_problem("load_lora_adapter", output(fresh), output(ref)), digests(got)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _full_params(model) -> dict:
    return {_clean(n): p for n, p in model.named_parameters() if not n.endswith("_flat_param")}


def _summon_cell(w):
    """Whole, exact parameters inside; sharded again after."""
    from torch.distributed.tensor import DTensor

    from omni.fsdp_utils import fsdp_summon_full_params

    model, ref = wrap(with_adapters("sd3", ("default",)), w), with_adapters("sd3", ("default",))
    train_step(model)
    train_step(ref)
    with fsdp_summon_full_params(model):
        inside = {k: p.detach().clone() for k, p in _full_params(model).items()}
        dtensors = [k for k, p in _full_params(model).items() if isinstance(p, DTensor)]
    problems = [f"DTensors inside the context: {dtensors[:3]}"] if dtensors else []
    problems += compare(inside, dict(ref.named_parameters()), model)
    after = list(model.parameters())
    full_numel = sum(p.numel() for p in ref.parameters())
    if w == "fsdp2" and not all(isinstance(p, DTensor) for p in after):
        problems.append("FSDP2 parameters not resharded after the context")
    if w.startswith("fsdp1") and sum(p.numel() for p in after) >= full_numel:
        problems.append("FSDP1 parameters not resharded after the context")
    return problems, digests(inside)


def _summon_writeback_cell(w):
    """Changes made inside a writeback context reach the shards (LoRA and base)."""
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params, fsdp_summon_full_params

    model, ref = wrap(with_adapters("sd3", ("default",)), w), with_adapters("sd3", ("default",))
    lora_key, base_key = "transformer_blocks.0.attn.to_q.lora_B.default.weight", "proj_out.base_layer.weight"
    with fsdp_summon_full_params(model, writeback=True):
        with torch.no_grad():
            for key in (lora_key, base_key):
                _full_params(model)[key].add_(1.0)
    with torch.no_grad():
        for key in (lora_key, base_key):
            dict(ref.named_parameters())[key].add_(1.0)
    got = collect_lora_params(model, False, True)
    problems = compare(got, get_peft_model_state_dict(ref), model)
    base = collect_lora_params(model, False, False)
    expected_base = build_sd3(0).state_dict()
    expected_base["proj_out.weight"] = expected_base["proj_out.weight"] + 1.0
    return problems + compare(base, expected_base, model), digests(got)


def _summon_grads_cell(w):
    """with_grads shows the whole (rank-averaged) gradients."""
    from omni.fsdp_utils import fsdp_summon_full_params

    model, ref = wrap(with_adapters("sd3", ("default",)), w), with_adapters("sd3", ("default",))
    backward(model)
    backward(ref)
    with fsdp_summon_full_params(model, with_grads=True):
        grads = {k: p.grad.clone() for k, p in _full_params(model).items() if p.grad is not None}
    expected = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    # FSDP1 shows a zero gradient for frozen parameters sharing a flat parameter with trainable ones
    extra = {k: g for k, g in grads.items() if k not in expected}
    problems = [f"non-zero gradient on frozen {k}" for k, g in extra.items() if g.any()]
    grads = {k: g for k, g in grads.items() if k in expected}
    return problems + compare(grads, expected, model), digests(grads)


def _gathering_cell(w):
    """Layered LoRA sync: FSDP1 holds one unit gathered at a time (with a LoRA-aware wrap
    only LoRA units), FSDP2 all-gathers only the LoRA tensors."""
    from contextlib import contextmanager
    from unittest import mock

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    from omni.fsdp_utils import collect_lora_params

    model = wrap(with_adapters("sd3", ("default",)), w)
    train_step(model)
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
    return problems, digests(got)


# ---------------------------------------------------------------------------------------
# FSDP2 mixed precision: fp32 masters whatever FSDP2 has registered on the modules
# ---------------------------------------------------------------------------------------


def _mp_model(w):
    return fully_shard(with_adapters("sd3", ("default",)), bf16=True, **MP_WRAPPINGS[w][1])


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
    ref = with_adapters("sd3", ("default",))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(masters[n])
    return ref


def _bring_to_state(model, state):
    """Put `model` in `state`; returns (the masters, a pending forward output or None)."""
    if state == "fresh":
        return _masters(model), None
    if state == "fwd_bwd":
        backward(model)
        return _masters(model), None
    if state == "nograd_fwd":  # a log-prob or validation pass after an update
        train_step(model)
        masters = _masters(model)
        output(model)
        return masters, None
    masters = _masters(model)  # grad_fwd: a forward, its backward after the collection
    return masters, model(**inputs(model))[0]


def _mp_collect_cell(w, state):
    """LoRA (whole and layered) and base: the fp32 masters; the module untouched (the same
    tensors registered, a second collection identical, backward and forward still work)."""
    from peft import get_peft_model_state_dict

    from omni.fsdp_utils import collect_lora_params

    model = _mp_model(w)
    masters, pending = _bring_to_state(model, state)
    ref = _masters_reference(masters)
    registered = _registered(model)
    expected_lora, expected_base = get_peft_model_state_dict(ref), build_sd3(0).state_dict()
    problems, collected = [], {}
    for what, layered, synced in (("lora", False, True), ("lora_layered", True, True), ("base", False, False)):
        collected[what] = got = collect_lora_params(model, layered, synced)
        problems += [f"{what}: {p}" for p in compare(got, expected_lora if synced else expected_base, model)]
    if _registered(model) != registered:
        problems.append("the collection changed the tensors registered on the module")
    if digests(collect_lora_params(model, True, True)) != digests(collected["lora"]):
        problems.append("a second collection differs from the first")
    (pending if pending is not None else model(**inputs(model))[0]).pow(2).mean().backward()
    output(model)  # and a no_grad forward after it
    again = collect_lora_params(model, False, True)
    problems += [f"after backward and a no_grad forward: {p}" for p in compare(again, expected_lora, model)]
    return problems, {**digests(collected["lora"]), **digests(collected["base"])}


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
    problems += compare(inside, masters, model)
    if _registered(model) != registered:
        problems.append("the summon did not restore the tensors registered on the module")
    train_step(model)
    return problems, digests(inside)


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
    problems += compare(got, get_peft_model_state_dict(ref), model)
    expected_base = build_sd3(0).state_dict()
    for key in ("transformer_blocks.1.attn.to_k.weight", "proj_out.weight"):
        expected_base[key] = expected_base[key] + 1.0
    problems += compare(collect_lora_params(model, False, False), expected_base, model)
    as_registered = output(model)  # with whatever compute copies the module holds
    for m in _fsdp2_modules(model):
        m.reshard()
    problems += output_problem("compute copies after writeback", as_registered, output(model))
    return problems, digests(got)


def _mp_summon_grads_cell(w):
    """After forward+backward and a no_grad forward: the fp32 gradients of every
    parameter that has one, whole."""
    from omni.fsdp_utils import fsdp_summon_full_params

    model = _mp_model(w)
    backward(model)
    expected = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    output(model)  # leaves the root unsharded, its gradients on the sharded parameters
    with fsdp_summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    problems = [] if expected else ["test precondition: no gradients"]
    return problems + compare(grads, expected, model), digests(grads)


def _mp_cells(world) -> dict:
    out = {}
    for w, (w_world, _) in MP_WRAPPINGS.items():
        if w_world != world:
            continue
        for state in MP_STATES:
            out[f"{w}-{state}"] = record(functools.partial(_mp_collect_cell, w, state))
        if w in MP_SUMMON_WRAPPINGS:
            out[f"{w}-summon"] = record(functools.partial(_mp_summon_cell, w))
            out[f"{w}-summon_writeback"] = record(functools.partial(_mp_summon_writeback_cell, w))
            out[f"{w}-summon_with_grads"] = record(functools.partial(_mp_summon_grads_cell, w))
        torch.distributed.barrier()
    return out


def _wrapping_cells(w) -> dict:
    out = _matrix_cells(w)
    out.update(_prefix_cells(w))
    out[f"{w}-diffusers_load_lora_adapter"] = record(lambda: _diffusers_loader_cell(w))
    out[f"{w}-layered_gathering"] = record(lambda: _gathering_cell(w))
    out[f"{w}-summon"] = record(lambda: _summon_cell(w))
    out[f"{w}-summon_writeback"] = record(lambda: _summon_writeback_cell(w))
    out[f"{w}-summon_with_grads"] = record(lambda: _summon_grads_cell(w))
    return out


def worker(rank: int, world: int, port: int, out_dir: str, wan_dir: str) -> None:
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
            results["fsdp2-wan_worker_sync"] = record(lambda: _wan_worker_cell(wan_dir, out_dir))
        results.update(_mp_cells(world))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
