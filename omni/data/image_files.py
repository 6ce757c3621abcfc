"""Image files of edit data: the columns that name an edit's source images, and images given
as bytes kept as files (so every process, and the family, reads sources from a path).

An image is a path (relative to the data's folder, or absolute), raw bytes, or a `datasets`
Image ({"bytes", "path"}). Bytes are written once to a file named by their hash under
`<OMNI_CACHE_DIR>/edit-images/`. Every image is checked to be whole when it is stored.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, Tuple

from PIL import Image

# An edit's source image(s): "images" holds a list, the others one image.
SOURCE_COLUMNS = ("images", "image", "source_image", "input_image")
STORE_ENV, STORE_DEFAULT, STORE_NAME = "OMNI_CACHE_DIR", "~/.cache/omni-recipes", "edit-images"


class BadImage(ValueError):
    """An image that cannot be used (its message says why; the caller adds where it is)."""


def image_store() -> Path:
    """Where images given as bytes are written (`<OMNI_CACHE_DIR>/edit-images`)."""
    return Path(os.environ.get(STORE_ENV) or STORE_DEFAULT).expanduser() / STORE_NAME


def source_paths(row: dict, base_dir: Path, store: Path) -> Tuple[Tuple[str, ...], str]:
    """(the files of a row's source images, the column naming them); ((), "") for a row
    without any. Raises BadImage for a column that holds no usable image."""
    column = next((c for c in SOURCE_COLUMNS if row.get(c) is not None), None)
    if column is None:
        return (), ""
    values = row[column]
    if column == "images":
        if not isinstance(values, (list, tuple)) or not values:
            raise BadImage("column 'images' must hold a non-empty list of images")
    else:
        values = [values]
    return tuple(stored_image(value, base_dir, column, store) for value in values), column


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
            raise BadImage(f"image file not found in column '{column}': {path}")
        _check_image(path, str(path))
        return str(path.resolve())
    raise BadImage(f"column '{column}' holds a {type(value).__name__}, not an image path or bytes")


def _check_image(source, name: str) -> None:
    try:
        with Image.open(source) as image:
            image.load()
    except Exception as error:  # PIL raises several types for corrupt or truncated data
        raise BadImage(f"cannot read image {name}: {error}") from None
