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
under `<OMNI_CACHE_DIR>/edit-images/` (`omni.data.image_files`), so every process reads
sources from files. Every row is read and every image checked to be whole when the set loads,
before any model: a bad row is an error naming its file and line (or row), or with
`skip_bad_rows` is skipped and logged. Then only the good rows' numbers stay in memory: an
`EditSet` reads an edit's row again when training asks for it, as preference pairs stream.
"""

from __future__ import annotations

import glob
import json
import logging
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
from PIL import Image

from omni.data.image_files import SOURCE_COLUMNS, BadImage, image_store, source_paths, stored_image
from omni.data.pair_sources import PairSource, open_pair_source
from omni.data.prompts import Prompt, source_images

logger = logging.getLogger(__name__)

INSTRUCTION_COLUMNS = ("prompt", "instruction", "edit_prompt")
TARGET_COLUMNS = ("target", "edited_image", "output_image")


def open_sources(prompt: str) -> List[Image.Image]:
    """The prompt's source images as RGB PIL images, in order; an edit prompt without
    sources, or a source that cannot be read, is an error naming the prompt's origin."""
    paths = source_images(prompt)
    where = getattr(prompt, "origin", "") or repr(str(prompt)[:60])
    if not paths:
        raise ValueError(f"{where}: an edit prompt needs at least one source image ('image' or 'images')")
    return [_open_rgb(path, where) for path in paths]


def _open_rgb(path: str, where: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: image {path} cannot be read ({error})") from None


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
) -> "EditSet":
    """The edit set at `spec`, every row checked (see the module docstring), read row by row
    as it is used."""
    try:
        source = open_pair_source(spec, key)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{key}={spec}: edit set not found (JSONL, parquet shards or a datasets directory of instructions "
            "with source images)"
        ) from None
    store = store or image_store()
    good, skipped = array("q"), 0
    for number, row in source.scan_rows():
        try:
            if isinstance(row, Exception):
                raise BadImage(str(row))
            edit_prompt(row, source.base_dir, _where(source, number), store)
            good.append(number)
        except BadImage as error:
            message = f"{key}={spec}: {_where(source, number)}: {error}"
            if not skip_bad_rows:
                raise ValueError(message) from None
            skipped += 1
            logger.warning("skipping an edit: %s", message)
    if not good:
        raise ValueError(
            f"{key}={spec}: the edit set has no edits" + (f" ({skipped} bad rows skipped)" if skipped else "")
        )
    return EditSet(source, np.frombuffer(good, dtype=np.int64), store)


class EditSet(Sequence):
    """The good rows of an edit set, each read from its file when it is asked for (training
    takes a step's few; a pass over the set reads it in chunks), as the preference pairs'
    rows are (`omni.data.pair_loader`): the set itself is never held in memory, only its good
    rows' numbers. An edit's images are files by then (the scan stored any bytes)."""

    CHUNK = 256  # rows read at once by a pass over the set

    def __init__(self, source: PairSource, rows: np.ndarray, store: Path):
        self.source, self.rows, self.store = source, rows, store

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        number = int(self.rows[index])
        (row,) = self.source.rows([number])
        return edit_prompt(row, self.source.base_dir, _where(self.source, number), self.store)

    def __iter__(self) -> Iterator[Prompt]:
        for start in range(0, len(self.rows), self.CHUNK):
            numbers = [int(n) for n in self.rows[start : start + self.CHUNK]]
            for number, row in zip(numbers, self.source.rows(numbers)):
                yield edit_prompt(row, self.source.base_dir, _where(self.source, number), self.store)


def _where(source: PairSource, number: int) -> str:
    path, place = source.where(number)
    return f"{path}, {place}"


def edit_prompt(row: Any, base_dir: Path, where: str, store: Path) -> Prompt:
    """One row -> an edit Prompt; raises BadImage saying what the row lacks."""
    if not isinstance(row, dict):
        raise BadImage(f"an edit row is an object with an instruction and a source image; got {type(row).__name__}")
    instruction_column, instruction = _first(row, INSTRUCTION_COLUMNS)
    if not isinstance(instruction, str) or not instruction.strip():
        raise BadImage(f"no instruction: one of the columns {list(INSTRUCTION_COLUMNS)} must hold a non-empty string")
    images, source_column = source_paths(row, base_dir, store)
    if not images:
        raise BadImage(f"no source image: one of the columns {list(SOURCE_COLUMNS)} must hold one")
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
