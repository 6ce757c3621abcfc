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
* FSDP2: each wanted parameter is gathered alone, with `full_tensor()`, from FSDP2's
  sharded parameter, never from what the module holds at the time: after a forward that
  leaves a unit unsharded (the root by default, every unit with
  `reshard_after_forward=False`; a no_grad log-prob or validation pass, or a forward whose
  backward has not run) FSDP2 has its unsharded compute copies registered there, in the
  mixed-precision `param_dtype` (e.g. bf16 for fp32 masters), or after a partial reshard
  (`reshard_after_forward=<int>`) bf16 shards. This never gathers base weights for a LoRA
  sync, returns the parameters' own dtype and values, and leaves the module as it was.
  With `CPUOffloadPolicy` the shards are gathered on the mesh's device, one at a time.
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
from collections.abc import Iterable, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

__all__ = ["collect_lora_params", "fsdp_summon_full_params", "fsdp_version", "state_nbytes"]

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_FLAT_PARAM = "_flat_param"


def state_nbytes(state: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> int:
    """Total bytes of the tensors in `state` (e.g. what `collect_lora_params` returned), or
    of an iterable of tensors (e.g. a module's parameters)."""
    tensors = state.values() if isinstance(state, Mapping) else state
    return sum(t.numel() * t.element_size() for t in tensors)


def _clean_name(raw: str) -> str:
    """Module/parameter name with FSDP, activation-checkpoint and compile wrappers removed."""
    return ".".join(s for s in raw.split(".") if s not in _WRAPPER_SEGMENTS)


def fsdp_version(module: nn.Module) -> int:
    """1 for an FSDP1 wrapper, 2 for a module `fully_shard` was applied to, else 0 (the
    module itself, not its descendants). Read from torch's own classes: importing verl
    for it would pull in Ray and tensordict, seconds at every start."""
    if isinstance(module, FSDP1):
        return 1
    return 2 if isinstance(module, FSDPModule) else 0


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


def _fsdp2_params(unit: nn.Module) -> list:
    """FSDP2's records (`FSDPParam`) of the parameters that FSDP2 unit `unit` manages.

    Private torch API, on purpose: FSDP2 offers no public way to reach a unit's sharded
    parameters while the unit is unsharded (`module.parameters()` then yields the unsharded
    compute copies), and the public way around, `reshard()` then `unshard()` to restore,
    would all-gather every parameter of each such unit, base weights included, on every
    LoRA sync. Each record holds the sharded parameter (`sharded_param`, a DTensor in the
    parameters' own dtype) and where FSDP2 registers it (`_module_info`).
    """
    try:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # newer torch: a list
        if groups is None:
            group = state._fsdp_param_group  # older torch: one group or None
            groups = [] if group is None else [group]
        return [fsdp_param for group in groups for fsdp_param in group.fsdp_params]
    except AttributeError as e:
        raise RuntimeError(
            f"omni.fsdp_utils reads FSDP2's sharded parameters from torch internals that torch "
            f"{torch.__version__} does not have ({e}); update omni.fsdp_utils._fsdp2_params"
        ) from e


def _fsdp2_slots(fsdp_param) -> list[tuple[nn.Module, str]]:
    """Every (module, parameter name) where FSDP2 registers this parameter (shared ones too)."""
    info = fsdp_param._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


def _fsdp2_sharded_params(units) -> dict[tuple[int, str], nn.Parameter]:
    """(id(module), parameter name) -> FSDP2's sharded parameter there, for FSDP2 `units`."""
    return {
        (id(m), name): fsdp_param.sharded_param
        for unit in units
        for fsdp_param in _fsdp2_params(unit)
        for m, name in _fsdp2_slots(fsdp_param)
    }


def _fsdp2_units(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _full_tensor(t) -> torch.Tensor:
    """The whole tensor of DTensor `t` (a collective), on the device of its mesh."""
    if t.device.type != t.device_mesh.device_type:
        # CPUOffloadPolicy keeps FSDP2's shards on the CPU while the mesh (NCCL) is the
        # accelerator's: gather there, as torch's own state-dict utilities do.
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


def _owned_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A whole CPU tensor with its own storage (FSDP1 views die with the summon)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if isinstance(t, DTensor):
        t = _full_tensor(t)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t)
    return out


def _collect_step(step: list[_Entry], layout: _PeftLayout, adapter: str | None, sharded: dict, out: OrderedDict):
    for e in step:
        if not _module_wanted(layout, e.name, e.module, adapter):
            continue
        for local, t in _own_tensors(e.module):
            kind = layout.classify(f"{e.name}.{local}" if e.name else local)
            if kind is not None and kind[0] == adapter:
                # FSDP2: the sharded parameter, whatever the module holds now (see above)
                out[kind[1]] = _owned_cpu_copy(sharded.get((id(e.module), local), t))


def _gather_and_collect(steps, layout: _PeftLayout, adapter: str | None, version: int, sharded: dict) -> OrderedDict:
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for step in steps:
        units = []
        if version == 1:
            wanted = [e for e in step if _module_wanted(layout, e.name, e.module, adapter)]
            units = list({id(e.owner): e.owner for e in wanted if e.owner is not None}.values())
        with _fsdp1_gather(units):
            _collect_step(step, layout, adapter, sharded, out)
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
    version = _wrapping(module)
    steps = [entries]
    if layered_summon:
        steps = [group for step in _layered_steps(entries, prefixes) for group in _split_by_owner(step)]
    if version == 1:
        _ensure_fsdp1_roots_initialized(entries)
    sharded = _fsdp2_sharded_params(_fsdp2_units(module)) if version == 2 else {}
    out = _gather_and_collect(steps, layout, adapter, version, sharded)
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


def _write_back_shard(sharded, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` into DTensor `sharded` (casting to its dtype)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.detach().to(sharded.device_mesh.device_type)
    # src_data_rank=None: every rank holds the same full tensor, slice locally.
    local = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
    with torch.no_grad():
        sharded.to_local().copy_(local.to_local())


@contextmanager
def _fsdp2_full_params(module: nn.Module, writeback: bool, with_grads: bool, recurse: bool):
    """Whole copies of FSDP2's sharded parameters (the masters, in their own dtype) put in
    place of whatever FSDP2 has registered on the modules (the sharded parameters, or the
    compute copies of units a forward left unsharded or partially resharded); on exit the
    same tensors as before are registered again, so FSDP2's state is as it was."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not recurse and not isinstance(module, FSDPModule):
        raise ValueError(
            "fsdp_summon_full_params(recurse=False) on a module that is not itself fully_shard-ed "
            f"({type(module).__name__}) would gather nothing; pass recurse=True or an FSDPModule"
        )
    fsdp_params = [fp for unit in (_fsdp2_units(module) if recurse else [module]) for fp in _fsdp2_params(unit)]
    registered = {(id(m), name): (m, name, m._parameters[name]) for fp in fsdp_params for m, name in _fsdp2_slots(fp)}
    fulls = []
    try:
        for fp in fsdp_params:
            sharded = fp.sharded_param
            full = nn.Parameter(_full_tensor(sharded.detach()), requires_grad=sharded.requires_grad)
            if with_grads and sharded.grad is not None:
                full.grad = _full_tensor(sharded.grad)
            fulls.append(full)
            for m, name in _fsdp2_slots(fp):
                m._parameters[name] = full
        yield
        if writeback:
            for fp, full in zip(fsdp_params, fulls):
                _write_back_shard(fp.sharded_param, full)
                m, name = _fsdp2_slots(fp)[0]
                held = registered[(id(m), name)][2]
                if held is fp.sharded_param:
                    continue
                # a compute copy a forward left registered: FSDP2 uses it as is until the
                # unit is resharded, so it gets the new values too
                if isinstance(held, DTensor):  # partially resharded after forward
                    _write_back_shard(held, full)
                else:  # unsharded
                    with torch.no_grad():
                        held.copy_(full)
    finally:
        for m, name, held in registered.values():
            m._parameters[name] = held


@contextmanager
def fsdp_summon_full_params(
    module: nn.Module, *, writeback: bool = False, with_grads: bool = False, recurse: bool = True
):
    """Whole parameters inside the context, as they were after.

    FSDP1: `FSDP.summon_full_params(module, writeback=, with_grads=, recurse=)`.
    FSDP2 (this module's own parameters, or all below it with `recurse`): whole copies of
    the sharded parameters, in their own dtype like FSDP1's (the fp32 masters under mixed
    precision, not the `param_dtype` compute copies), gathered one parameter at a time and
    registered on the modules; on exit the tensors registered before are registered again,
    so units a forward left unsharded stay so. `with_grads` exposes the whole gradients of
    the sharded parameters; `writeback` copies changes made inside back into the shards,
    and into the compute copies of units left unsharded. Do not run forward or backward
    inside. Plain modules: no-op.
    Collective under FSDP: enter it on every rank.
    """
    version = _wrapping(module)
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(module, writeback=writeback, with_grads=with_grads, recurse=recurse):
            yield
    elif version == 2:
        with _fsdp2_full_params(module, writeback, with_grads, recurse):
            yield
    else:
        yield
