"""Checks that a learned reward's weights file is whole, at validation, before any model loads.

A copy cut short or a file damaged in transfer otherwise fails deep inside `safetensors`,
`torch.load` or `from_pretrained`, with a message that names neither the reward nor the file.
What is checked, without loading a tensor:
  * `.safetensors`: the header (8-byte length, then JSON) parses, and the file is exactly as
    long as the header's last tensor says;
  * `.pth` / `.pt` / `.bin` / `.ckpt`: torch's zip format opens (its directory is at the end,
    so a truncated file does not) and every member's CRC matches (one read of the file); the
    legacy pickle format is accepted as far as its first byte (`torch.load` reads the rest,
    and its failure is named at set-up, `load_error`).
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Optional

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", *TORCH_SUFFIXES)


def _safetensors_problem(path: Path) -> Optional[str]:
    size = path.stat().st_size
    with path.open("rb") as stream:
        head = stream.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"its header claims {length} bytes, the file has {size}: truncated"
        try:
            header = json.loads(stream.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return f"its header is not JSON ({error})"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    expected = 8 + length + max(ends, default=0)
    if expected != size:
        return (
            f"its tensors end at byte {expected}, the file has {size}: "
            f"{'truncated' if size < expected else 'trailing bytes'}"
        )
    return None


def _torch_problem(path: Path) -> Optional[str]:
    with path.open("rb") as stream:
        first = stream.read(4)
    if not zipfile.is_zipfile(path):
        if first[:1] == b"\x80":  # torch's legacy (pickle) format: read by torch.load at set-up
            return None
        if first == b"PK\x03\x04":
            return "torch's zip format without its closing directory: truncated"
        return "neither torch's zip format nor its legacy pickle format (corrupt)"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        return f"a damaged zip archive ({error})"
    return f"member {bad} fails its CRC check (corrupt)" if bad else None


def weights_problem(path: Path) -> Optional[str]:
    """Why the weights file `path` cannot be whole, or None (unknown suffixes are not checked)."""
    if path.suffix == ".safetensors":
        return _safetensors_problem(path)
    if path.suffix in TORCH_SUFFIXES:
        return _torch_problem(path)
    return None


def check_weights_file(path, key: str, name: str) -> None:
    """Raise ValueError naming reward `name`, its option `key` and the file when the weights
    file at `path` is truncated or corrupt."""
    path = Path(path).expanduser()
    problem = weights_problem(path)
    if problem:
        raise ValueError(
            f"{key}={path}: reward '{name}' cannot use this weights file: {problem}; copy or download it again"
        )


def check_weights_dir(directory, key: str, name: str) -> None:
    """`check_weights_file` on each weights file of a model directory (save_pretrained's)."""
    directory = Path(directory).expanduser()
    for path in sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        problem = weights_problem(path)
        if problem:
            raise ValueError(
                f"{key}={directory}: reward '{name}' cannot use its weights file {path}: {problem}; copy or "
                "download it again"
            )


def load_error(path, key: str, name: str, error: Exception) -> ValueError:
    """A library's failure to read the weights at `path`, as an error naming reward and file."""
    return ValueError(
        f"{key}={path}: reward '{name}' cannot read this weights file ({type(error).__name__}: {str(error)[:300]})"
    )
