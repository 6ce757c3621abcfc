"""Collect LoRA or base weights from a (possibly FSDP-sharded) diffusion transformer.

A rollout engine needs whole weights: the full base model once, then only the LoRA
tensors after each training step. The trained module may be plain, wrapped with FSDP1
(`FullyShardedDataParallel`, `use_orig_params` True or False, any auto-wrap policy) or
sharded with FSDP2 (`fully_shard`). LoRA is added either by diffusers'
`model.add_adapter(LoraConfig(...), adapter_name=...)` or by peft's
`inject_adapter_in_model`; both give the same module layout, which is read from the
module itself (PEFT tuner layers), never from a `PeftModel` wrapper.

Naming of what `collect_lora_params` returns:

* base (`base_sync_done=False`): the plain transformer's `state_dict()` names, i.e.
  wrapper segments (`_fsdp_wrapped_module`, `_checkpoint_wrapped_module`, `_orig_mod`)
  and PEFT's `base_layer` removed, LoRA tensors left out; loadable with
  `load_state_dict(strict=True)` into a fresh unwrapped transformer.
* LoRA (`base_sync_done=True`): PEFT's adapter state-dict naming, as
  `peft.get_peft_model_state_dict` returns it (`transformer_blocks.0.attn.to_q.lora_A.weight`,
  adapter name removed); loadable with `peft.set_peft_model_state_dict(model, sd,
  adapter_name=...)` or diffusers' `model.load_lora_adapter(sd, prefix=None, ...)`.
  Prefix the keys with `transformer.` for a pipeline's `load_lora_weights`.

How the weights are made whole:

* FSDP1: `FSDP.summon_full_params(unit, recurse=False)` of the FSDP units that own a
  wanted tensor (all at once, or one at a time when layered), so units holding only base weights are
  never gathered for a LoRA sync (with a LoRA-aware wrap policy only the small LoRA units
  are). A unit is gathered whole: if the wrap policy leaves blocks unwrapped, the unit
  owning them (often the root) is gathered for each of its blocks.
* FSDP2: each wanted `DTensor` parameter is gathered alone with `full_tensor()`. This
  never gathers base weights for a LoRA sync, and returns the parameters' own dtype
  (an `unshard()` would follow the mixed-precision `param_dtype`).
* plain: nothing to gather.

`layered_summon=True` walks the blocks under `layer_prefixes` one at a time and then the
root-level remainder (LoRA on `proj_out`, `context_embedder`... is kept), so at most one
FSDP unit (about one block) is gathered at a time. It is only valid for the LoRA sync
(`base_sync_done=True`): the base sync returns the whole model anyway. On a plain module
there is nothing to gather; the layered walk still validates the prefixes and collects
the same tensors.

Every tensor returned is whole, on CPU, owns its storage and equals what the unwrapped
model holds; all ranks return identical dicts (every rank must call, FSDP gathers are
collectives).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from verl.utils.fsdp_utils import fsdp_version

__all__ = ["collect_lora_params", "fsdp_summon_full_params", "state_nbytes"]

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_FLAT_PARAM = "_flat_param"


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    """Total bytes of the tensors in `state` (e.g. what `collect_lora_params` returned)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def _clean_name(raw: str) -> str:
    """Module/parameter name with FSDP, activation-checkpoint and compile wrappers removed."""
    return ".".join(s for s in raw.split(".") if s not in _WRAPPER_SEGMENTS)


def _wrapping(module: nn.Module) -> int:
    """0 (plain), 1 (FSDP1) or 2 (FSDP2), looking at the module and its descendants."""
    return max(fsdp_version(m) for m in module.modules())


def _is_fsdp1(module: nn.Module) -> bool:
    return fsdp_version(module) == 1


# ---------------------------------------------------------------------------------------
# PEFT layout: which tensors are LoRA (of which adapter) and which are base weights
# ---------------------------------------------------------------------------------------


@dataclass
class _PeftLayout:
    tuner_layers: set[str] = field(default_factory=set)  # clean names of PEFT tuner layers
    # clean name of each adapter-keyed container (e.g. `...to_q.lora_A`) -> the container
    containers: dict[str, nn.Module] = field(default_factory=dict)
    adapters: list[str] = field(default_factory=list)

    def adapter_of_module(self, name: str) -> str | None:
        """Adapter whose container holds module `name` (e.g. `...lora_A.default`), else None."""
        segs = name.split(".")
        for i in range(1, len(segs)):
            if ".".join(segs[:i]) in self.containers:
                return segs[i]
        return None

    def classify(self, name: str) -> tuple[str | None, str] | None:
        """(adapter, PEFT key) for a LoRA tensor, (None, plain name) for a base tensor,
        None for other PEFT-owned state that belongs to neither."""
        segs = name.split(".")
        for i in range(1, len(segs)):
            if ".".join(segs[:i]) in self.containers:
                rest = segs[i + 1 :]
                key = ".".join(segs[:i] + rest)
                # PEFT keeps DoRA's magnitude under its pre-refactor name (no `.weight`).
                if segs[i - 1] == "lora_magnitude_vector" and rest == ["weight"]:
                    key = key.removesuffix(".weight")
                return segs[i], key
        kept = []
        for i, seg in enumerate(segs):
            if ".".join(segs[:i]) in self.tuner_layers:
                if seg != "base_layer":
                    return None
                continue
            kept.append(seg)
        return None, ".".join(kept)


def _peft_layout(module: nn.Module) -> _PeftLayout:
    from peft.tuners.tuners_utils import BaseTunerLayer

    layout = _PeftLayout()
    adapters: dict[str, None] = {}
    for raw, m in module.named_modules():
        if not isinstance(m, BaseTunerLayer):
            continue
        name = _clean_name(raw)
        layout.tuner_layers.add(name)
        for attr in m.adapter_layer_names:
            container = getattr(m, attr, None)
            if isinstance(container, (nn.ModuleDict, nn.ParameterDict)):
                layout.containers[f"{name}.{attr}"] = container
                adapters.update(dict.fromkeys(container.keys()))
    layout.adapters = list(adapters)
    return layout


def _module_wanted(layout: _PeftLayout, name: str, module: nn.Module, adapter: str | None) -> bool:
    """Whether `module` may directly hold a wanted tensor (base when `adapter` is None)."""
    if adapter is None:
        return layout.adapter_of_module(name) is None
    if name in layout.containers:  # a ParameterDict keeps its adapters' tensors itself
        return isinstance(module, nn.ParameterDict) and adapter in module
    return layout.adapter_of_module(name) == adapter


# ---------------------------------------------------------------------------------------
# Module walk: clean names, owning FSDP1 unit, blocks
# ---------------------------------------------------------------------------------------


@dataclass
class _Entry:
    name: str  # clean name
    module: nn.Module
    owner: nn.Module | None  # the FSDP1 unit whose flat parameter holds this module's params
    outermost_unit: bool  # an FSDP1 unit with no FSDP1 ancestor


def _entries(root: nn.Module) -> list[_Entry]:
    owners: dict[str, nn.Module | None] = {}
    out = []
    for raw, m in root.named_modules():
        parent_owner = owners.get(raw.rpartition(".")[0]) if raw else None
        owner = m if _is_fsdp1(m) else parent_owner
        owners[raw] = owner
        out.append(_Entry(_clean_name(raw), m, owner, _is_fsdp1(m) and parent_owner is None))
    return out


def _norm_prefixes(prefixes) -> tuple[str, ...]:
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return tuple(p.rstrip(".") + "." for p in prefixes)


def _block_of(name: str, prefixes: tuple[str, ...]) -> str | None:
    """`transformer_blocks.3` for any name inside that block, else None."""
    for p in prefixes:
        if name.startswith(p):
            index = name[len(p) :].split(".", 1)[0]
            if index.isdigit():
                return p + index
    return None


def _block_containers(entries: list[_Entry]) -> list[str]:
    """Names of the outermost ModuleLists (the block stacks, e.g. `transformer_blocks`)."""
    lists = [e.name for e in entries if isinstance(e.module, nn.ModuleList)]
    return [n for n in dict.fromkeys(lists) if not any(n.startswith(o + ".") for o in lists)]


def _layered_steps(entries: list[_Entry], prefixes: tuple[str, ...]) -> list[list[_Entry]]:
    """Entries grouped per block (in model order), then the root-level remainder."""
    blocks: dict[str, list[_Entry]] = {}
    remainder = []
    for e in entries:
        block = _block_of(e.name, prefixes)
        (blocks.setdefault(block, []) if block else remainder).append(e)
    missing = [p for p in prefixes if not any(b.startswith(p) for b in blocks)]
    if missing:
        raise ValueError(
            f"layer_prefixes {list(prefixes)}: {missing} match no block of the model; "
            f"its block containers are {_block_containers(entries)} "
            f"(pass e.g. layer_prefixes=('transformer_blocks.',))"
        )
    return [*blocks.values(), remainder]


def _split_by_owner(step: list[_Entry]) -> list[list[_Entry]]:
    """The step's entries grouped by owning FSDP1 unit, so each group gathers one unit."""
    groups: dict[int, list[_Entry]] = {}
    for e in step:
        groups.setdefault(id(e.owner), []).append(e)
    return list(groups.values())


# ---------------------------------------------------------------------------------------
# Gathering and copying
# ---------------------------------------------------------------------------------------


def _ensure_fsdp1_roots_initialized(entries: list[_Entry]) -> None:
    """FSDP1 marks the first unit it summons as root; summoning a nested unit of a model
    that never ran forward would make it a root and break the real root later."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for e in entries:
        if e.outermost_unit and e.module._is_root is None:
            with FSDP.summon_full_params(e.module, recurse=False, writeback=False):
                pass


@contextmanager
def _fsdp1_gather(units: list[nn.Module]):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with ExitStack() as stack:
        for unit in units:
            stack.enter_context(FSDP.summon_full_params(unit, recurse=False, writeback=False))
        yield


def _own_tensors(module: nn.Module):
    """(local name, tensor) of the module's direct parameters and persistent buffers."""
    for name, p in module._parameters.items():
        if p is not None and name != _FLAT_PARAM:
            yield name, p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield name, b


def _owned_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A whole CPU tensor with its own storage (FSDP1 views die with the summon)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    return out


def _collect_step(step: list[_Entry], layout: _PeftLayout, adapter: str | None, out: OrderedDict) -> None:
    for e in step:
        if not _module_wanted(layout, e.name, e.module, adapter):
            continue
        for local, t in _own_tensors(e.module):
            kind = layout.classify(f"{e.name}.{local}" if e.name else local)
            if kind is not None and kind[0] == adapter:
                out[kind[1]] = _owned_cpu_copy(t)


def _gather_and_collect(steps, layout: _PeftLayout, adapter: str | None, fsdp1: bool) -> OrderedDict:
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for step in steps:
        units = []
        if fsdp1:
            wanted = [e for e in step if _module_wanted(layout, e.name, e.module, adapter)]
            units = list({id(e.owner): e.owner for e in wanted if e.owner is not None}.values())
        with _fsdp1_gather(units):
            _collect_step(step, layout, adapter, out)
    return out


def collect_lora_params(
    module: nn.Module,
    layered_summon: bool,
    base_sync_done: bool,
    is_diffusers: bool = False,
    adapter_name: str = "default",
    layer_prefixes=("transformer_blocks.",),
) -> OrderedDict[str, torch.Tensor]:
    """Whole CPU copies of the base weights (`base_sync_done=False`) or of adapter
    `adapter_name`'s LoRA tensors (`base_sync_done=True`); see the module docstring.

    `is_diffusers` is accepted for verl's signature: the LoRA layout is read from the
    module's PEFT tuner layers, so diffusers (`add_adapter`) and peft
    (`inject_adapter_in_model`) models need no flag, and the names do not change with it.
    `layer_prefixes` are only used (and validated) when `layered_summon` is set.
    Collective under FSDP: call it on every rank.
    """
    del is_diffusers
    if layered_summon and not base_sync_done:
        raise ValueError(
            "layered_summon=True needs base_sync_done=True: the layered walk only syncs LoRA "
            "weights and assumes the base weights are already in the rollout engine; sync the "
            "base once with layered_summon=False first"
        )
    prefixes = _norm_prefixes(layer_prefixes)
    layout = _peft_layout(module)
    adapter = adapter_name if base_sync_done else None
    if adapter is not None and adapter not in layout.adapters:
        raise ValueError(f"adapter {adapter_name!r} not found in the model; adapters present: {layout.adapters}")

    entries = _entries(module)
    fsdp1 = _wrapping(module) == 1
    steps = [entries]
    if layered_summon:
        steps = [group for step in _layered_steps(entries, prefixes) for group in _split_by_owner(step)]
    if fsdp1:
        _ensure_fsdp1_roots_initialized(entries)
    out = _gather_and_collect(steps, layout, adapter, fsdp1)
    if not out:
        what = f"LoRA tensors of adapter {adapter_name!r}" if adapter else "base tensors"
        raise ValueError(
            f"collected no {what} (adapter_name={adapter_name!r}, layer_prefixes={list(prefixes)}, "
            f"layered_summon={layered_summon}); adapters present: {layout.adapters}"
        )
    return out


# ---------------------------------------------------------------------------------------
# Full-parameter context
# ---------------------------------------------------------------------------------------


def _fsdp2_param_slots(module: nn.Module, recurse: bool):
    """(owning module, name, sharded DTensor param) managed by `module` (and, with
    `recurse`, by its nested FSDP2 modules)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    stack = [module]
    while stack:
        m = stack.pop()
        for name, p in m._parameters.items():
            if isinstance(p, DTensor):
                yield m, name, p
        stack.extend(c for c in m.children() if recurse or not isinstance(c, FSDPModule))


def _write_back_shard(sharded, full: torch.Tensor) -> None:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the same full tensor, slice locally.
    local = distribute_tensor(full.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None)
    with torch.no_grad():
        sharded.to_local().copy_(local.to_local())


@contextmanager
def _fsdp2_unsharded(module: nn.Module, writeback: bool, with_grads: bool, recurse: bool):
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)] if recurse else [module]
    if not isinstance(units[0], FSDPModule):
        raise ValueError(
            "fsdp_summon_full_params(recurse=False) on a module that is not itself fully_shard-ed "
            f"({type(module).__name__}) would gather nothing; pass recurse=True or an FSDPModule"
        )
    slots = list(_fsdp2_param_slots(module, recurse))
    for unit in units:
        unit.unshard()
    try:
        if with_grads:
            for m, name, sharded in slots:
                if sharded.grad is not None:
                    full = m._parameters[name]
                    full.grad = sharded.grad.full_tensor().to(full.dtype)
        yield
        if writeback:
            for m, name, sharded in slots:
                _write_back_shard(sharded, m._parameters[name])
    finally:
        if with_grads:
            for m, name, _ in slots:
                m._parameters[name].grad = None
        for unit in units:
            unit.reshard()


@contextmanager
def fsdp_summon_full_params(
    module: nn.Module, *, writeback: bool = False, with_grads: bool = False, recurse: bool = True
):
    """Whole parameters inside the context, sharded again after.

    FSDP1: `FSDP.summon_full_params(module, writeback=, with_grads=, recurse=)`.
    FSDP2: `unshard()` of the FSDP modules (this one, or all below it with `recurse`), then
    `reshard()`; parameters follow the mixed-precision `param_dtype`. `with_grads` exposes
    the gathered gradients on the whole parameters (dropped on exit), `writeback` copies
    changes made inside back into the shards. Plain modules: no-op.
    Collective under FSDP: enter it on every rank.
    """
    version = _wrapping(module)
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(module, writeback=writeback, with_grads=with_grads, recurse=recurse):
            yield
    elif version == 2:
        with _fsdp2_unsharded(module, writeback, with_grads, recurse):
            yield
    else:
        yield
