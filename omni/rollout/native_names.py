"""Base-weight names: `collect_lora_params`' plain state-dict names -> vLLM-Omni's parameters.

`rollout.options.backend=native` runs vLLM-Omni's own transformer of the family, whose
modules follow diffusers' names except where vLLM-Omni fuses projections into one parallel
linear layer or renames a module path part: the family states both (`native.fused`,
`native.renamed`, `native.renamed_parameters`; `omni.models.native`). For SD3, FLUX and
Qwen-Image `to_q`/`to_k`/`to_v` are the shards q/k/v of `to_qkv`, and the context stream's
`add_q_proj`/`add_k_proj`/`add_v_proj` those of `add_kv_proj`; Qwen-Image's `to_out.0`
(diffusers' list's first entry, the output linear) is vLLM-Omni's `to_out`. Wan fuses its
self-attention's (`attn1`) q/k/v only, names its feed-forward's layers `net_0`/`net_2` and
keeps the output's `scale_shift_table` in a module. A weight is loaded by its target
parameter's own `weight_loader` (which places a shard and, under tensor parallelism, slices
it), so we name the target and the shard; loading checks that every target parameter (every
shard of a fused one) gets exactly one tensor.

No vLLM import here: the rules are the family's plain data, tested without the engine env.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Set, Tuple

from omni.rollout.native_support import weight_facts

Target = Tuple[str, Optional[str]]  # (vLLM-Omni's parameter name, shard or None)


def native_module(family: str, module: str) -> str:
    """A plain module path (`transformer_blocks.0.attn.to_out.0`) under vLLM-Omni's
    renames (`transformer_blocks.0.attn.to_out`); fused projections keep their plain name."""
    dotted = f".{module}."
    for plain, native in weight_facts(family).renamed:
        dotted = dotted.replace(f".{plain}.", f".{native}.")
    return dotted[1:-1]


def native_name(family: str, plain: str) -> Target:
    """The vLLM-Omni parameter (and shard) that the plain tensor `plain` loads into."""
    facts = weight_facts(family)
    moved = dict(facts.renamed_parameters)
    if plain in moved:  # a root parameter vLLM-Omni keeps in a module
        return moved[plain], None
    module, _, leaf = plain.rpartition(".")  # leaf: weight, bias
    module = native_module(family, module)
    fused = facts.fused_module(module)
    if fused is not None:
        return f"{fused[0]}.{leaf}", fused[1]
    return f"{module}.{leaf}" if module else leaf, None


def native_names(family: str, plain_names: Iterable[str]) -> Dict[str, Target]:
    """Every plain name's target; two names on one target is an error naming both."""
    targets: Dict[str, Target] = {}
    seen: Dict[Target, str] = {}
    for name in plain_names:
        target = native_name(family, name)
        if target in seen:
            raise KeyError(f"{name} and {seen[target]} both map to vLLM-Omni's {target}")
        seen[target] = name
        targets[name] = target
    return targets


def expected_targets(family: str, native_param_names: Iterable[str]) -> Set[Target]:
    """What a complete base sync fills: each parameter of vLLM-Omni's module, each shard
    of a fused one."""
    shards: Dict[str, Set[str]] = {}
    for fused, shard in weight_facts(family).fused.values():
        shards.setdefault(fused, set()).add(shard)
    out: Set[Target] = set()
    for name in native_param_names:
        module = name.rpartition(".")[0]
        leaf = module.rpartition(".")[2]
        out.update((name, s) for s in shards[leaf]) if leaf in shards else out.add((name, None))
    return out


def check_complete(family: str, targets: Iterable[Target], native_param_names: Iterable[str]) -> None:
    """Every target parameter and shard filled once, nothing else: else a KeyError naming them."""
    got, want = set(targets), expected_targets(family, native_param_names)
    missing, unexpected = sorted(want - got, key=str), sorted(got - want, key=str)
    if missing or unexpected:
        raise KeyError(
            f"base weights for vLLM-Omni's {family} transformer: {len(missing)} missing {missing[:5]}, "
            f"{len(unexpected)} unexpected {unexpected[:5]}"
        )
