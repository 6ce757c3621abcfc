"""Edit data: an instruction and the source image(s) it applies to.

An edit item is an `omni.data.prompts.Prompt` whose text is the instruction and whose `images`
are the source image files (one for FLUX.1 Kontext, one or more for Qwen-Image-Edit-Plus); an
optional target image (what the edit should give) rides in its metadata as "target", a path.
Edit families (`ModelFamily.edit`) open the sources when they encode the prompt; edit rewards
open them to compare the result with the source.

An edit set is read with `omni.data.pair_sources` (so from the same layouts as preference
pairs): JSONL (one file, a folder or a glob), parquet shards, or a `datasets` save_to_disk
directory. A row holds
  * the instruction: "prompt", "instruction" or "edit_prompt";
  * the source(s): "images" (a list) or "image" / "source_image" / "input_image" (one);
  * optionally the target: "target", "edited_image" or "output_image";
  * anything else: the item's metadata.
An image is a path (relative to the JSONL file's folder, or absolute), raw bytes, or a
`datasets` Image ({"bytes", "path"}). Bytes are written once to a file named by their hash
under `<OMNI_CACHE_DIR>/edit-images/`, so every process reads sources from files. Every row is
read and every image checked to be whole when the set loads, before any model: a bad row is
an error naming its file and line (or row), or with `skip_bad_rows` is skipped and logged.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from PIL import Image

from omni.data.pair_sources import open_pair_source
from omni.data.prompts import Prompt, source_images

logger = logging.getLogger(__name__)

INSTRUCTION_COLUMNS = ("prompt", "instruction", "edit_prompt")
SOURCE_COLUMNS = ("images", "image", "source_image", "input_image")
TARGET_COLUMNS = ("target", "edited_image", "output_image")
STORE_ENV, STORE_DEFAULT, STORE_NAME = "OMNI_CACHE_DIR", "~/.cache/omni-recipes", "edit-images"


class BadEdit(ValueError):
    """A row that is no edit (its message says why; the caller adds the file and line)."""


def open_sources(prompt: str) -> List[Image.Image]:
    """The prompt's source images as RGB PIL images, in order; an edit prompt without
    sources, or a source that cannot be read, is an error naming the prompt's origin."""
    paths = source_images(prompt)
    where = getattr(prompt, "origin", "") or repr(str(prompt)[:60])
    if not paths:
        raise ValueError(f"{where}: an edit prompt needs at least one source image ('image' or 'images')")
    return [_open_rgb(path, where) for path in paths]


def open_target(prompt: str) -> Optional[Image.Image]:
    """The prompt's target image (RGB), or None when the edit names none."""
    path = getattr(prompt, "metadata", {}).get("target")
    return None if path is None else _open_rgb(path, getattr(prompt, "origin", "") or repr(str(prompt)[:60]))


def _open_rgb(path: str, where: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: image {path} cannot be read ({error})") from None


def image_store() -> Path:
    """Where images given as bytes are written (`<OMNI_CACHE_DIR>/edit-images`)."""
    return Path(os.environ.get(STORE_ENV) or STORE_DEFAULT).expanduser() / STORE_NAME


def is_edit_set(path: Path | str) -> bool:
    """Whether the data at `path` is an edit set: parquet, a folder, a glob, or a JSONL file
    whose first row names a source image."""
    text = str(path)
    if glob.has_magic(text):
        return True
    path = Path(text).expanduser()
    if path.is_dir() or path.suffix == ".parquet":
        return True
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with path.open("rb") as stream:
        for raw in stream:
            if raw.strip():
                try:
                    row = json.loads(raw)
                except ValueError:
                    return False
                return isinstance(row, dict) and any(column in row for column in SOURCE_COLUMNS)
    return False


def load_edits(
    spec: str, key: str = "data.train", skip_bad_rows: bool = False, store: Optional[Path] = None
) -> List[Prompt]:
    """Every edit of the set at `spec` as a Prompt (see the module docstring)."""
    try:
        source = open_pair_source(spec, key)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{key}={spec}: edit set not found (JSONL, parquet shards or a datasets directory of instructions "
            "with source images)"
        ) from None
    store = store or image_store()
    edits, skipped = [], 0
    for number, row in source.scan_rows():
        path, place = source.where(number)
        where = f"{path}, {place}"
        try:
            if isinstance(row, Exception):
                raise BadEdit(str(row))
            edits.append(edit_prompt(row, source.base_dir, where, store))
        except BadEdit as error:
            message = f"{key}={spec}: {where}: {error}"
            if not skip_bad_rows:
                raise ValueError(message) from None
            skipped += 1
            logger.warning("skipping an edit: %s", message)
    if not edits:
        raise ValueError(
            f"{key}={spec}: the edit set has no edits" + (f" ({skipped} bad rows skipped)" if skipped else "")
        )
    return edits


def edit_prompt(row: Any, base_dir: Path, where: str, store: Path) -> Prompt:
    """One row -> an edit Prompt; raises BadEdit saying what the row lacks."""
    if not isinstance(row, dict):
        raise BadEdit(f"an edit row is an object with an instruction and a source image; got {type(row).__name__}")
    instruction_column, instruction = _first(row, INSTRUCTION_COLUMNS)
    if not isinstance(instruction, str) or not instruction.strip():
        raise BadEdit(f"no instruction: one of the columns {list(INSTRUCTION_COLUMNS)} must hold a non-empty string")
    source_column, sources = _first(row, SOURCE_COLUMNS)
    if sources is None:
        raise BadEdit(f"no source image: one of the columns {list(SOURCE_COLUMNS)} must hold one")
    if source_column == "images":
        if not isinstance(sources, (list, tuple)) or not sources:
            raise BadEdit("column 'images' must hold a non-empty list of images")
    else:
        sources = [sources]
    images = [stored_image(value, base_dir, source_column, store) for value in sources]
    metadata = {k: v for k, v in row.items() if k not in (instruction_column, source_column) + TARGET_COLUMNS}
    metadata = {k: v for k, v in metadata.items() if _plain(v)}
    target_column, target = _first(row, TARGET_COLUMNS)
    if target is not None:
        metadata["target"] = stored_image(target, base_dir, target_column, store)
    return Prompt(instruction.strip(), metadata, where, images)


def _first(row: Dict[str, Any], columns: Tuple[str, ...]) -> Tuple[Optional[str], Any]:
    for column in columns:
        if row.get(column) is not None:
            return column, row[column]
    return None, None


def _plain(value: Any) -> bool:
    """Whether a metadata value is plain data (JSON), not an image's bytes."""
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def stored_image(value: Any, base_dir: Path, column: str, store: Path) -> str:
    """The file holding the image `value` (a path, bytes or a {"bytes", "path"} dict), checked
    to be a whole image; bytes are written to `store` under their hash."""
    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        _check_image(io.BytesIO(data), f"the bytes in column '{column}'")
        path = store / f"{hashlib.sha256(data).hexdigest()}.img"
        if not path.is_file():
            store.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(data)
            partial.replace(path)  # atomic: another process never reads half a file
        return str(path)
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise BadEdit(f"image file not found in column '{column}': {path}")
        _check_image(path, str(path))
        return str(path.resolve())
    raise BadEdit(f"column '{column}' holds a {type(value).__name__}, not an image path or bytes")


def _check_image(source, name: str) -> None:
    try:
        with Image.open(source) as image:
            image.load()
    except Exception as error:  # PIL raises several types for corrupt or truncated data
        raise BadEdit(f"cannot read image {name}: {error}") from None
