"""How the training driver and an out-of-process rollout engine exchange data.

Two channels, both built on safetensors so tensors cross bit-exact:

- messages: one HTTP POST per call whose body (both ways) is a safetensors blob; the
  non-tensor part rides in its metadata as JSON (`pack` / `unpack`; the driver's client
  is `omni.rollout.engine_client`);
- weights: a directory per sync in a directory both sides can read, written atomically
  (a temporary directory renamed into place), so the engine never sees half a file. Base
  weights are `model.safetensors`; a LoRA is a PEFT adapter directory
  (`adapter_model.safetensors` + `adapter_config.json`, loadable by PEFT and vLLM).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import load, load_file, save, save_file

from omni.atomic import write_directory
from omni.config.model import LoraConfig

BASE_FILE = "model.safetensors"
LORA_FILE = "adapter_model.safetensors"
LORA_CONFIG_FILE = "adapter_config.json"
SYNC_FILE = "omni_sync.json"
# PEFT saves adapter tensors under the wrapped model's prefix.
PEFT_PREFIX = "base_model.model."
_JSON_KEY = "json"


# ----------------------------------------------------------------- messages
def pack(tensors: Optional[Dict[str, torch.Tensor]] = None, meta: Optional[Dict[str, Any]] = None) -> bytes:
    """Tensors and JSON-able metadata -> one safetensors blob."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in (tensors or {}).items()}
    return save(tensors, metadata={_JSON_KEY: json.dumps(meta or {})})


def unpack(blob: bytes) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Inverse of `pack`."""
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    meta = json.loads(header.get("__metadata__", {}).get(_JSON_KEY, "{}"))
    return dict(load(blob)), meta


# ----------------------------------------------------------------- weights
def _owned(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Contiguous CPU tensors; safetensors refuses two names on one storage, so copy repeats."""
    out, storages = {}, set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in storages else t
        storages.add(storage)
    return out


def write_base_weights(root: Path, name: str, tensors: Dict[str, torch.Tensor]) -> Path:
    """The transformer's full weights (plain state_dict names) as root/name/model.safetensors."""

    def write(tmp: Path) -> None:
        save_file(_owned(tensors), str(tmp / BASE_FILE))
        (tmp / SYNC_FILE).write_text(json.dumps({"kind": "base"}))

    return write_directory(Path(root) / name, write)


def write_lora_adapter(root: Path, name: str, tensors: Dict[str, torch.Tensor], lora: LoraConfig) -> Path:
    """A LoRA (PEFT names without the adapter name) as a PEFT adapter directory."""
    from omni.weights import peft_lora_config

    def write(tmp: Path) -> None:
        save_file({PEFT_PREFIX + k: v for k, v in _owned(tensors).items()}, str(tmp / LORA_FILE))
        peft_lora_config(lora).save_pretrained(str(tmp))
        (tmp / SYNC_FILE).write_text(json.dumps({"kind": "lora", "adapter_name": lora.adapter_name}))

    return write_directory(Path(root) / name, write)


def sync_kind(path: Path) -> str:
    """'base' or 'lora': what a directory written above holds."""
    return json.loads((Path(path) / SYNC_FILE).read_text())["kind"]


def read_weights(path: Path, device: str = "cpu") -> Tuple[str, Dict[str, torch.Tensor], Optional[LoraConfig]]:
    """(kind, tensors, lora) from a directory written above; kind is 'base' or 'lora'."""
    path = Path(path)
    sync = json.loads((path / SYNC_FILE).read_text())
    if sync["kind"] == "base":
        return "base", load_file(str(path / BASE_FILE), device=device), None
    config = json.loads((path / LORA_CONFIG_FILE).read_text())
    lora = LoraConfig(
        rank=config["r"],
        alpha=config["lora_alpha"],
        target_modules=sorted(config["target_modules"]),
        adapter_name=sync["adapter_name"],
    )
    tensors = load_file(str(path / LORA_FILE), device=device)
    return "lora", {k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else k: v for k, v in tensors.items()}, lora
