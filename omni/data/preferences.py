"""Preference pairs (prompt, chosen image, rejected image) for Diffusion-DPO.

`load_preference_pairs` reads pairs from
  * a JSONL file: one object a line with `prompt`, `chosen`, `rejected` (image paths, relative
    to the file's directory or absolute);
  * a parquet file (needs pyarrow): the same columns, images as paths, bytes or
    {"bytes": ..., "path": ...} structs;
  * a Hugging Face `datasets` directory written by `save_to_disk` (needs datasets).
Any of them may instead use Pick-a-Pic's columns: `caption`, `jpg_0`, `jpg_1`, `label_0`
(1: image 0 preferred, 0: image 1 preferred, 0.5: a tie, skipped and counted).

A bad row (missing column, missing or unreadable image, empty prompt, label outside
{0, 0.5, 1}) is an error naming the file and the row (the 1-based line of a JSONL file, the
1-based row of a table); with `skip_bad_rows=True` it is skipped, counted in the returned stats
and logged. Images are decoded when loaded, as RGB PIL images.

`write_synthetic_pairs` writes a small deterministic set in which the chosen image is always
the brighter one, for tests and tiny end-to-end runs.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

logger = logging.getLogger(__name__)

STANDARD_COLUMNS = ("prompt", "chosen", "rejected")
PICKAPIC_COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0")
VALID_LABELS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: Image.Image  # RGB
    rejected: Image.Image  # RGB


class BadRow(ValueError):
    """A row that cannot become a pair; the loader adds the file and row number."""


class TiedRow(Exception):
    """A Pick-a-Pic row labelled as a tie (label_0 = 0.5): skipped and counted, not an error."""


# ----------------------------------------------------------------------------- decoding a row


def _open_image(value, base_dir: Path, column: str) -> Image.Image:
    """A path (relative to `base_dir` or absolute), raw bytes, a {"bytes", "path"} dict or a PIL
    image -> a decoded RGB PIL image."""
    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if value is None:
        raise BadRow(f"column '{column}' holds no image")
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray, memoryview)):
        source, name = io.BytesIO(bytes(value)), f"the bytes in column '{column}'"
    elif isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        source = path if path.is_absolute() else base_dir / path
        if not source.is_file():
            raise BadRow(f"image file not found in column '{column}': {source}")
        name = str(source)
    else:
        raise BadRow(f"column '{column}' holds a {type(value).__name__}, not an image path or bytes")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except Exception as error:  # PIL raises several types for corrupt or truncated data
        raise BadRow(f"cannot read image {name}: {error}") from error


def _prompt(value, column: str) -> str:
    if not isinstance(value, str):
        raise BadRow(f"column '{column}' holds a {type(value).__name__}, not a text prompt")
    if not value.strip():
        raise BadRow(f"empty prompt in column '{column}'")
    return value.strip()


def _require_columns(row: dict, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in row]
    if missing:
        raise BadRow(f"missing column(s) {', '.join(repr(c) for c in missing)} (has {sorted(row)})")


def _pickapic_label(value) -> float:
    try:
        label = float(value)
    except (TypeError, ValueError):
        raise BadRow(f"label_0 is {value!r}, expected one of 0, 0.5, 1") from None
    if label not in VALID_LABELS:
        raise BadRow(f"label_0 is {value!r}, expected one of 0, 0.5, 1")
    return label


def _parse_row(row, base_dir: Path) -> PreferencePair:
    """One row in either layout -> a pair; raises BadRow or TiedRow."""
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with columns, got a {type(row).__name__}")
    if "jpg_0" in row or "label_0" in row:
        _require_columns(row, PICKAPIC_COLUMNS)
        label = _pickapic_label(row["label_0"])
        if label == 0.5:
            raise TiedRow()
        chosen, rejected = ("jpg_0", "jpg_1") if label == 1.0 else ("jpg_1", "jpg_0")
        prompt_column = "caption"
    else:
        _require_columns(row, STANDARD_COLUMNS)
        chosen, rejected, prompt_column = "chosen", "rejected", "prompt"
    return PreferencePair(
        prompt=_prompt(row[prompt_column], prompt_column),
        chosen=_open_image(row[chosen], base_dir, chosen),
        rejected=_open_image(row[rejected], base_dir, rejected),
    )


# ----------------------------------------------------------------------------- reading files


def _jsonl_rows(path: Path) -> Iterator[Tuple[str, object]]:
    """(where, row) for each non-blank line; a line that is not UTF-8 JSON yields its error."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield f"line {number}", BadRow(f"not UTF-8 text ({error.reason} at byte {error.start})")
                continue
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as error:
                yield f"line {number}", BadRow(f"not valid JSON: {error}")


def _parquet_rows(path: Path) -> Iterator[Tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading the parquet file {path} needs pyarrow: pip install pyarrow") from error
    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"row {number}", row


def _saved_dataset_rows(path: Path) -> Iterator[Tuple[str, object]]:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"reading the saved dataset {path} needs the datasets library: pip install datasets") from error
    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError as error:
        raise ValueError(f"{path} is a directory but not a dataset saved with save_to_disk: {error}") from error
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset and len(dataset) != 1:
            raise ValueError(f"{path} holds splits {list(dataset)}; save one split or name it 'train'")
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):  # undecoded, so a corrupt image is our row error
            dataset = dataset.cast_column(name, datasets.Image(decode=False))
    for number, row in enumerate(dataset, start=1):
        yield f"row {number}", row


def _rows(path: Path) -> Iterator[Tuple[str, object]]:
    if path.is_dir():
        return _saved_dataset_rows(path)
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    raise ValueError(f"{path}: unsupported preference file; expected .jsonl, .parquet or a save_to_disk directory")


def load_preference_pairs(
    path: str | os.PathLike, key: str = "data.pairs", skip_bad_rows: bool = False
) -> Tuple[List[PreferencePair], Dict[str, int]]:
    """All pairs of a JSONL file, parquet file or saved dataset directory, and the counts
    {"rows", "pairs", "skipped_bad", "skipped_ties"}. See the module docstring for formats."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}={path}: preference data not found")
    base_dir = path if path.is_dir() else path.parent
    pairs: List[PreferencePair] = []
    stats = {"rows": 0, "pairs": 0, "skipped_bad": 0, "skipped_ties": 0}
    for where, row in _rows(path):
        stats["rows"] += 1
        try:
            if isinstance(row, BadRow):
                raise row
            pairs.append(_parse_row(row, base_dir))
        except TiedRow:
            stats["skipped_ties"] += 1
        except BadRow as error:
            message = f"{key}={path}, {where}: {error}"
            if not skip_bad_rows:
                raise ValueError(message) from error
            stats["skipped_bad"] += 1
            logger.warning("skipping a bad preference row: %s", message)
    stats["pairs"] = len(pairs)
    if stats["skipped_bad"]:
        logger.warning("%s=%s: skipped %d bad row(s) of %d", key, path, stats["skipped_bad"], stats["rows"])
    if not pairs:
        raise ValueError(f"{key}={path}: no preference pairs ({stats})")
    return pairs, stats


# ----------------------------------------------------------------------------- images -> tensors


def _resize_and_center_crop(image: Image.Image, resolution: int) -> Image.Image:
    """Scale so the shorter side is `resolution`, then cut the centred square."""
    width, height = image.size
    if (width, height) != (resolution, resolution):
        scale = resolution / min(width, height)
        size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
        image = image.crop((left, top, left + resolution, top + resolution))
    return image


def images_to_tensor(images: Sequence[Image.Image], resolution: int) -> torch.Tensor:
    """PIL images -> a float32 batch (B, 3, resolution, resolution) in [0, 1]
    (map to [-1, 1] with 2x - 1 before a VAE that expects it)."""
    if not images:
        raise ValueError("images_to_tensor needs at least one image")
    arrays = [np.asarray(_resize_and_center_crop(im.convert("RGB"), resolution), dtype=np.uint8) for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float().div(255.0)


# ----------------------------------------------------------------------------- a synthetic set


def _smooth_images(n: int, resolution: int, generator: torch.Generator) -> torch.Tensor:
    """`n` random smooth RGB images in [0, 1]: a coarse 4x4 grid of colours upsampled."""
    coarse = torch.rand(n, 3, 4, 4, generator=generator)
    return F.interpolate(coarse, size=(resolution, resolution), mode="bilinear", align_corners=False).clamp(0, 1)


def _save_png(image: torch.Tensor, path: Path) -> None:
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)


def write_synthetic_pairs(
    out_dir: str | os.PathLike, n_pairs: int, resolution: int = 64, seed: int = 0, prompts: Optional[Sequence[str]] = None
) -> Path:
    """Write `n_pairs` pairs (PNGs under images/ and pairs.jsonl) and return the JSONL's path.

    The chosen image has pixel values in [0.5, 1], the rejected one in [0, 0.5]: the chosen
    image is always the brighter. Prompts default to the colors_train set, taken in a seeded
    order. The same arguments always write the same files."""
    if n_pairs < 1 or resolution < 1:
        raise ValueError(f"n_pairs and resolution must be positive, got {n_pairs} and {resolution}")
    if prompts is None:
        from omni.data.prompts import load_prompts

        prompts = load_prompts("omni:colors_train")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompts), generator=generator).tolist() * math.ceil(n_pairs / len(prompts))
    chosen = 0.5 + 0.5 * _smooth_images(n_pairs, resolution, generator)
    rejected = 0.5 * _smooth_images(n_pairs, resolution, generator)
    rows = []
    for i in range(n_pairs):
        names = {side: f"images/pair_{i:05d}_{side}.png" for side in ("chosen", "rejected")}
        _save_png(chosen[i], out_dir / names["chosen"])
        _save_png(rejected[i], out_dir / names["rejected"])
        rows.append(json.dumps({"prompt": prompts[order[i]], **names}))
    jsonl = out_dir / "pairs.jsonl"
    jsonl.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return jsonl
