"""Receiving weights: PEFT LoRA adapters on a plain transformer, loaded from named tensors.

The names are those `omni.fsdp_utils.collect_lora_params` returns: base weights under the
plain transformer's `state_dict()` names, LoRA tensors in PEFT's naming without the adapter
name (`...to_q.lora_A.weight`). Loading is strict: a missing or unexpected name is an error.
"""

from __future__ import annotations

import re
import warnings
from typing import Dict, List

import torch

from omni.config.model import LoraConfig

_LORA_PART = r"(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)"
_LORA_KEY = re.compile(rf"\.{_LORA_PART}\.")


def peft_lora_config(lora: LoraConfig):
    """PEFT's LoraConfig of `lora`; peft is imported here, not with the module, so that
    composing and validating a config (omni/known_bad.py's check) never import it."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        exclude_modules=list(lora.exclude_modules) or None,
        init_lora_weights=True,
    )


def add_lora_adapter(transformer, lora: LoraConfig) -> None:
    """Inject a LoRA adapter named `lora.adapter_name` (B = 0, so outputs are unchanged), its
    weights in fp32 whatever the base's dtype: the actor's trainable masters must not round
    Adam's steps away, and the engine computes the LoRA exactly as the actor does (PEFT casts
    the input to the LoRA's dtype and the result back to the base layer's)."""
    transformer.add_adapter(peft_lora_config(lora), adapter_name=lora.adapter_name)
    for param in lora_tensors(transformer, lora.adapter_name).values():
        param.data = param.data.float()


# The snapshot adapter that, when an algorithm keeps one, is the reference policy
# (omni/workers/actor_rollout.py).
REFERENCE_SNAPSHOT = "reference_snapshot"


def add_snapshot_adapter(transformer, lora: LoraConfig, name: str) -> None:
    """A frozen LoRA adapter `name` beside the trained one, with the trained adapter's
    configuration and a copy of its current weights; the trained adapter stays the active,
    trainable one. Added before FSDP wraps the transformer, as the trained adapter is."""
    if name == lora.adapter_name:
        raise ValueError(
            f"a snapshot adapter cannot take the trained adapter's name {name!r} (model.lora.adapter_name)"
        )
    with warnings.catch_warnings():  # PEFT warns that a second adapter is one: it is meant to be
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        transformer.add_adapter(peft_lora_config(lora), adapter_name=name)  # now the active one
    trained = lora_tensors(transformer, lora.adapter_name)
    for key, param in lora_tensors(transformer, name).items():
        param.data = trained[key].detach().clone().float()
    transformer.set_adapter(lora.adapter_name)  # active and trainable again; the snapshot frozen


def is_lora_name(name: str) -> bool:
    return bool(_LORA_KEY.search(name))


def lora_module_names(names) -> List[str]:
    """The modules (plain names, `...attn.to_q`) that LoRA tensor names (PEFT's, with or
    without the adapter name) belong to, sorted, each once."""
    return sorted({name[: match.start()] for name in names if (match := _LORA_KEY.search(name))})


def plain_base_names(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The module's non-LoRA tensors under plain names (`.base_layer` removed)."""
    return {
        name.replace(".base_layer", ""): t
        for name, t in module.state_dict(keep_vars=True).items()
        if not is_lora_name(name)
    }


def lora_tensors(module: torch.nn.Module, adapter_name: str) -> Dict[str, torch.Tensor]:
    """The adapter's parameters under PEFT's names without the adapter name."""
    pattern = re.compile(rf"\.{_LORA_PART}\.{re.escape(adapter_name)}(\.|$)")
    found = {}
    for name, param in module.named_parameters():
        plain = pattern.sub(lambda m: f".{m.group(1)}{m.group(2)}", name)
        if plain != name:
            found[plain] = param
    return found


def module_lora_names(tensors: Dict[str, torch.Tensor], adapter_name: str) -> Dict[str, torch.Tensor]:
    """PEFT names without the adapter (`...lora_A.weight`) -> the module's own names
    (`...lora_A.<adapter>.weight`): the inverse of `lora_tensors`' naming."""
    return {_LORA_KEY.sub(lambda m: f".{m.group(1)}.{adapter_name}.", k, count=1): v for k, v in tensors.items()}


@torch.no_grad()
def copy_named(targets: Dict[str, torch.Tensor], tensors: Dict[str, torch.Tensor], what: str) -> None:
    missing = sorted(set(targets) - set(tensors))
    unexpected = sorted(set(tensors) - set(targets))
    if missing or unexpected:
        raise KeyError(f"{what}: {len(missing)} missing {missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}")
    for name, target in targets.items():
        source = tensors[name]
        if source.shape != target.shape:
            raise ValueError(f"{what}: {name} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
        target.copy_(source.to(target.device, target.dtype))


def load_base_weights(module: torch.nn.Module, tensors: Dict[str, torch.Tensor]) -> None:
    copy_named(plain_base_names(module), tensors, "base weights")


def load_lora_weights(module: torch.nn.Module, tensors: Dict[str, torch.Tensor], adapter_name: str) -> None:
    targets = lora_tensors(module, adapter_name)
    if not targets:
        raise KeyError(f"the module has no LoRA adapter named '{adapter_name}'")
    copy_named(targets, tensors, f"LoRA adapter '{adapter_name}'")
