"""Checkpoints: the trained weights in diffusers' format plus the trainer state, written atomically.

Layout of `<output_dir>/checkpoints/step_000010/`:
    pytorch_lora_weights.safetensors   a LoRA run: loadable by the family's pipeline (`load_lora_weights`);
                                       a family of two experts (Wan2.2) may write the second expert's
                                       as pytorch_lora_weights_transformer_2.safetensors
    transformer/                       full fine-tuning (`model.lora=null`): the whole transformer,
                                       diffusion_pytorch_model.safetensors + config.json, loadable
                                       with `<TransformerClass>.from_pretrained(dir, subfolder="transformer")`
    trainer_state.pt                   step, optimizer state, RNG states
A checkpoint is written to a temporary directory and renamed into place, and `latest` is
replaced only after that, so an interrupted save never damages what was already saved.
Resuming takes the newest checkpoint that passes `check_checkpoint`; the temporary
directories a killed save leaves behind are cleaned at the next start. A checkpoint that
cannot be read is damaged (DamagedCheckpoint); one saved by another configuration (model
family, LoRA or full fine-tuning, LoRA rank, alpha or targets, read from the config its
trainer state records) is not, and is never passed over (CheckpointMismatch). A save that
fails raises CheckpointSaveFailed naming the checkpoint, the disk when it is full, and the
checkpoints kept.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from omni.atomic import write_directory, write_text

LORA_FILE = "pytorch_lora_weights.safetensors"
TRANSFORMER_DIR = "transformer"
TRANSFORMER_FILE = f"{TRANSFORMER_DIR}/diffusion_pytorch_model.safetensors"
TRANSFORMER_CONFIG = f"{TRANSFORMER_DIR}/config.json"
STATE_FILE = "trainer_state.pt"


def rng_state() -> Dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_lora(directory: Path, lora: Dict[str, torch.Tensor], lora_config, family) -> None:
    """The LoRA as the family's diffusers pipeline saves it, with the adapter's PEFT config."""
    from omni.weights import peft_lora_config

    metadata = peft_lora_config(lora_config).to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    family.save_lora(directory, lora, metadata)


def save_transformer(directory: Path, weights: Dict[str, torch.Tensor], transformer_config: dict) -> None:
    """The whole transformer as diffusers saves one: its weights (plain state_dict names) and
    its config, in `directory/transformer/`."""
    from safetensors.torch import save_file

    (Path(directory) / TRANSFORMER_DIR).mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(Path(directory) / TRANSFORMER_FILE))
    (Path(directory) / TRANSFORMER_CONFIG).write_text(json.dumps(dict(transformer_config), indent=2, sort_keys=True))


def save_checkpoint(
    root: Path,
    step: int,
    weights: Dict[str, torch.Tensor],
    lora_config,
    state: Dict[str, Any],
    family,
    transformer_config: Optional[dict] = None,
) -> Path:
    """The LoRA (`lora_config` set) or, for full fine-tuning (`lora_config` None), the whole
    transformer with its `transformer_config`, and the trainer state."""

    def write(tmp: Path) -> None:
        if lora_config is None:
            save_transformer(tmp, weights, transformer_config)
        else:
            save_lora(tmp, weights, lora_config, family)
        torch.save({"step": step, **state}, tmp / STATE_FILE)

    final = Path(root) / f"step_{step:06d}"
    try:
        write_directory(final, write)
        write_text(Path(root) / "latest", final.name)
    except Exception as error:  # safetensors and torch.save wrap an OSError in their own types
        raise CheckpointSaveFailed(save_failure(final, error)) from error
    return final


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written; the message names it, the disk and what was kept."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(error: BaseException) -> bool:
    """An OSError(ENOSPC/EDQUOT), or a serializer's error that wraps one (safetensors reports
    it as `Os { code: 28, kind: StorageFull }`)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return True
        if any(text in str(error) for text in ("No space left", "StorageFull", "Disk quota exceeded")):
            return True
        error = error.__cause__ or error.__context__
    return False


def mount_point(path: Path) -> Path:
    path = Path(path).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def save_failure(final: Path, error: BaseException) -> str:
    """What failed, where, why, and what is still there to continue from."""
    root = final.parent
    older = [p.name for p in sorted(root.glob("step_*")) if p.is_dir() and p != final]
    kept = (
        f"the checkpoints saved before it are intact ({', '.join(older[-3:])})"
        if older
        else "no earlier checkpoint exists"
    )
    if out_of_space(error):
        usage = shutil.disk_usage(root)
        cause = (
            f"no space left on the disk holding {root} (the filesystem mounted at {mount_point(root)}; "
            f"{usage.free / 2**20:.1f} MiB free now of {usage.total / 2**30:.1f} GiB)"
        )
    else:
        cause = f"{type(error).__name__}: {error}"
    return f"could not save checkpoint {final}: {cause}; {kept}, and no partial checkpoint was left behind"


class DamagedCheckpoint(ValueError):
    """A checkpoint directory that cannot be resumed from; the message names the file."""


def step_of(directory: Path) -> int:
    return int(directory.name.removeprefix("step_"))


def weights_files(directory: Path) -> List[Path]:
    """The checkpoint's weights: the whole transformer's file when there is one, else the
    LoRA's files (`LORA_FILE`, and an expert's beside it; `LORA_FILE` when there is none)."""
    directory = Path(directory)
    if (directory / TRANSFORMER_FILE).is_file():
        return [directory / TRANSFORMER_FILE]
    found = sorted(directory.glob(f"{Path(LORA_FILE).stem}*.safetensors"))
    return found or [directory / LORA_FILE]


class CheckpointMismatch(ValueError):
    """An intact checkpoint of another configuration (model family, LoRA or full fine-tuning,
    LoRA rank, alpha or targets): not damaged, so never passed over nor written over; the
    message names each difference, saved against configured."""


def check_checkpoint(directory: Path, model=None) -> None:
    """Read a checkpoint's headers without loading its tensors: the weights and the state
    present, the safetensors header readable, the trainer state readable (DamagedCheckpoint
    naming the file otherwise), and, given the run's `model` config, saved by the same
    configuration: the model family and LoRA settings of the saved config, and weights of
    the kind and shapes `model` trains (CheckpointMismatch naming the differences otherwise)."""
    from safetensors import safe_open

    directory = Path(directory)
    files, state_file = weights_files(directory), directory / STATE_FILE
    for path in (*files, state_file):
        if not path.is_file():
            raise DamagedCheckpoint(
                f"{path}: missing (a checkpoint holds {LORA_FILE} or {TRANSFORMER_FILE}, and {STATE_FILE})"
            )
    shapes = {}
    for weights in files:
        try:
            with safe_open(str(weights), framework="pt") as f:
                shapes.update({f"{weights.stem}:{key}": f.get_slice(key).get_shape() for key in f.keys()})
        except Exception as error:  # safetensors raises its own error types for a bad header
            raise DamagedCheckpoint(f"{weights}: unreadable safetensors ({error})") from None
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        int(state["step"])
    except Exception as error:  # a truncated pickle raises anything from EOFError to UnpicklingError
        raise DamagedCheckpoint(f"{state_file}: unreadable trainer state ({type(error).__name__}: {error})") from None
    if model is not None:
        differences = config_differences(state.get("config"), model) or weights_differences(
            files[0], shapes, model.lora
        )
        if differences:
            raise CheckpointMismatch(f"{directory} was saved by another configuration: {'; '.join(differences)}")


def saved_model(config_yaml) -> Optional[dict]:
    """The `model` section of the config a checkpoint's trainer state holds (None: none saved)."""
    from omegaconf import OmegaConf

    if not config_yaml:
        return None
    return OmegaConf.to_container(OmegaConf.create(config_yaml)).get("model")


def config_differences(config_yaml, model) -> List[str]:
    """Saved against configured: model family, full fine-tuning or a LoRA, its rank, alpha, targets."""
    saved = saved_model(config_yaml)
    if saved is None:
        return []
    if saved.get("family") != model.family:
        return [f"saved model family {saved.get('family')}, configured {model.family} (model.family)"]
    lora = saved.get("lora")
    if (lora is None) != (model.lora is None):
        return [kind_difference(full_saved=lora is None)]
    if lora is None:
        return []
    if sorted(saved.get("train_experts") or []) != sorted(model.train_experts) and saved.get("train_experts"):
        return [f"saved experts {saved['train_experts']}, configured {list(model.train_experts)} (model.train_experts)"]
    differences = [
        f"saved LoRA {what} {lora[key]}, configured {getattr(model.lora, key)} (model.lora.{key})"
        for key, what in (("rank", "rank"), ("alpha", "alpha"))
        if lora[key] != getattr(model.lora, key)
    ]
    if sorted(lora["target_modules"] or []) != sorted(model.lora.target_modules or []):
        differences.append(
            f"saved LoRA targets {sorted(lora['target_modules'])}, configured {sorted(model.lora.target_modules)} "
            "(model.lora.target_modules)"
        )
    return differences


def kind_difference(full_saved: bool) -> str:
    if full_saved:
        return "saved the whole transformer (full fine-tuning, model.lora=null), configured a LoRA (model.lora)"
    return "saved a LoRA, configured full fine-tuning (model.lora=null)"


def weights_differences(weights: Path, shapes: Dict[str, list], lora_config) -> List[str]:
    """What the weights' headers say, for a checkpoint whose state holds no config."""
    full = weights.parent.name == TRANSFORMER_DIR
    if full != (lora_config is None):
        return [kind_difference(full_saved=full)]
    return [] if full else lora_differences(shapes, lora_config)


def lora_differences(shapes: Dict[str, list], lora_config) -> List[str]:
    """A LoRA's tensors (names and shapes) against `lora_config`'s rank and targets."""
    ranks = {shape[0] for key, shape in shapes.items() if ".lora_A." in key}
    if ranks != {lora_config.rank}:
        return [
            f"saved LoRA rank {', '.join(map(str, sorted(ranks)))}, configured {lora_config.rank} (model.lora.rank)"
        ]
    modules = {key.split(".lora_A.")[0] for key in shapes if ".lora_A." in key}
    targets = set(lora_config.target_modules)
    found = {t for t in targets if any(m == t or m.endswith("." + t) for m in modules)}
    stray = sorted(m for m in modules if not any(m == t or m.endswith("." + t) for t in targets))
    if found != targets or stray:
        return [
            f"saved LoRA on other modules than model.lora.target_modules={sorted(targets)} (missing "
            f"{sorted(targets - found)}, unexpected {stray[:3]})"
        ]
    return []


def checkpoint_dirs(root: Path) -> List[Path]:
    """The step directories under `root`, newest first."""
    root = Path(root)
    return sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=step_of, reverse=True)


def resumable_checkpoint(root: Path, model=None) -> Tuple[Optional[Path], List[str]]:
    """The newest intact checkpoint under `root` (None if there is none) and, for each newer
    one that is damaged, why it was passed over. `latest` is only a hint: a checkpoint it
    names that is missing or damaged does not hide older intact ones. A checkpoint of
    another configuration is not damaged: CheckpointMismatch, never passed over."""
    skipped = []
    for directory in checkpoint_dirs(root):
        try:
            check_checkpoint(directory, model)
            return directory, skipped
        except DamagedCheckpoint as error:
            skipped.append(str(error))
    return None, skipped


PEFT_LORA_FILE = "adapter_model.safetensors"
LORA_PREFIXES = ("transformer.", "base_model.model.")  # diffusers' pipeline files, PEFT's save_pretrained


def lora_file(path: Path) -> Path:
    """The LoRA file `path` names: itself, or the diffusers or PEFT file in a directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = [path / name for name in (LORA_FILE, PEFT_LORA_FILE) if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: holds neither {LORA_FILE} (diffusers) nor {PEFT_LORA_FILE} (PEFT)")
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such LoRA file or directory")
    return path


def transformer_lora_names(names) -> Dict[str, str]:
    """A LoRA file's tensor names -> PEFT's names on the transformer (`...to_q.lora_A.weight`)."""
    plain = {}
    for name in names:
        if ".lora_" not in name:
            continue
        prefix = next((p for p in LORA_PREFIXES if name.startswith(p)), "")
        plain[name] = name[len(prefix) :]
    return plain


def check_lora_file(path: Path, lora_config) -> Path:
    """The LoRA file of `path`, its header read (no tensors): of `lora_config`'s rank and targets.
    Raises DamagedCheckpoint or CheckpointMismatch naming the file."""
    from safetensors import safe_open

    file = lora_file(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            names = transformer_lora_names(f.keys())
            shapes = {plain: f.get_slice(name).get_shape() for name, plain in names.items()}
    except Exception as error:  # safetensors raises its own error types for a bad header
        raise DamagedCheckpoint(f"{file}: unreadable safetensors ({error})") from None
    if not shapes:
        raise CheckpointMismatch(f"{file}: holds no transformer LoRA tensors (names with .lora_A./.lora_B.)")
    differences = lora_differences(shapes, lora_config)
    if differences:
        raise CheckpointMismatch(f"{file}: {'; '.join(differences)}")
    return file


def load_lora_file(path: Path) -> Dict[str, torch.Tensor]:
    """A LoRA file's transformer tensors under PEFT's names (as `lora_state_dict` returns them)."""
    from safetensors.torch import load_file

    tensors = load_file(str(lora_file(path)))
    return {plain: tensors[name] for name, plain in transformer_lora_names(tensors).items()}


def prune_checkpoints(checkpoints: List[Path], keep: int) -> List[Path]:
    """Delete all but the newest `keep` of `checkpoints`; returns the deleted ones. Each is
    renamed to a hidden leftover first, which the next start cleans if the deletion is cut."""
    deleted = []
    for old in sorted(set(checkpoints), key=step_of)[:-keep]:
        aside = old.parent / f".{old.name}.pruned"
        os.replace(old, aside)
        shutil.rmtree(aside)
        deleted.append(old)
    return deleted


def latest_checkpoint(root: Path) -> Optional[Path]:
    return resumable_checkpoint(root)[0]


def clean_interrupted_writes(root: Path) -> List[str]:
    """Remove what a killed save left under `root` (its temporary directories); a step that
    was renamed aside and never replaced is put back. Returns what was done, for the log."""
    root = Path(root)
    done = []
    for leftover in sorted(root.glob(".step_*")) if root.is_dir() else []:
        name = leftover.name[1:].split(".")[0]
        if ".old." in leftover.name and not (root / name).exists():
            leftover.rename(root / name)
            done.append(f"restored {name} from {leftover.name}")
        else:
            shutil.rmtree(leftover, ignore_errors=True)
            done.append(f"removed {leftover.name}")
    return done


def load_checkpoint(directory: Path, family):
    """(the trained weights, trainer state) of a checkpoint directory: PEFT-named LoRA
    tensors, or the whole transformer's under plain state_dict names."""
    from safetensors.torch import load_file

    directory = Path(directory)
    check_checkpoint(directory)
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
    if (directory / TRANSFORMER_FILE).is_file():
        return load_file(str(directory / TRANSFORMER_FILE)), state
    return family.load_lora(directory), state
