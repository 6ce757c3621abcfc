"""Preference pairs (prompt, chosen image, rejected image) for Diffusion-DPO: the layout of
a row, its checks, decoding, and a synthetic set.

A video model's pairs hold clips instead: each of `chosen` and `rejected` is a path to an mp4
file or a folder of frames (`omni.videos`), of exactly the run's `rollout.num_frames` frames
(`num_frames` below; None for an image model's pairs).

A row has `prompt`, `chosen`, `rejected` (images as paths relative to the data's directory
or absolute, raw bytes, or {"bytes": ..., "path": ...} structs), or Pick-a-Pic's columns:
`caption`, `jpg_0`, `jpg_1`, `label_0` (1: image 0 preferred, 0: image 1 preferred, 0.5: a
tie, skipped and counted). An edit model's pairs also name the edit's source image(s), in an
`image` or `images` column (`omni.data.image_files`): two results of one edit, the preferred
one `chosen`. Files are read lazily by `omni.data.pair_sources` (JSONL, parquet shards, a
`datasets` directory).

`check_row` finds a bad row (missing column, missing, unreadable or truncated image, empty
prompt, label outside {0, 0.5, 1}) without decoding PNG and JPEG images: it reads a PNG's
chunks with their CRCs and a JPEG's header and end marker (other formats are decoded).
`decode_row` decodes both images as RGB PIL images, and `images_to_tensor` makes a batch of
them for the VAE.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image

from omni.data.image_files import SOURCE_COLUMNS, BadImage, image_store, source_paths
from omni.data.prompts import Prompt

STANDARD_COLUMNS = ("prompt", "chosen", "rejected")
PICKAPIC_COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0")
VALID_LABELS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: Union[Image.Image, np.ndarray]  # RGB; a clip: uint8 frames (F, H, W, 3)
    rejected: Union[Image.Image, np.ndarray]


class BadRow(ValueError):
    """A row that cannot become a pair; the loader adds the file and row number."""


class TiedRow(Exception):
    """A Pick-a-Pic row labelled as a tie (label_0 = 0.5): skipped and counted, not an error."""


# ----------------------------------------------------------------------------- decoding a row


def _image_source(value, base_dir: Path, column: str):
    """(a file path or byte stream PIL can open, its name for messages)."""
    if isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if value is None:
        raise BadRow(f"column '{column}' holds no image")
    if isinstance(value, Image.Image):
        return value, f"the image in column '{column}'"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(value)), f"the bytes in column '{column}'"
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        source = path if path.is_absolute() else base_dir / path
        if not source.is_file():
            raise BadRow(f"image file not found in column '{column}': {source}")
        return source, str(source)
    raise BadRow(f"column '{column}' holds a {type(value).__name__}, not an image path or bytes")


def _open_image(value, base_dir: Path, column: str, decode: bool = True) -> Optional[Image.Image]:
    """A path (relative to `base_dir` or absolute), raw bytes, a {"bytes", "path"} dict or a PIL
    image -> a decoded RGB PIL image; without `decode`, it is only checked to be whole (None)."""
    source, name = _image_source(value, base_dir, column)
    if isinstance(source, Image.Image):
        return source.convert("RGB") if decode else None
    try:
        with Image.open(source) as image:
            if decode:
                return image.convert("RGB")
            _check_whole(image, source)
            return None
    except BadRow:
        raise
    except Exception as error:  # PIL raises several types for corrupt or truncated data
        raise BadRow(f"cannot read image {name}: {error}") from error


def _check_whole(image: Image.Image, source) -> None:
    """Find a truncated image without decoding it where that is cheap: a PNG's chunks are
    read through to IEND with their CRCs (`verify`), a JPEG must end with its end-of-image
    marker; any other format is decoded. Raises for an incomplete image."""
    if image.format == "PNG":
        try:
            image.verify()
        except Exception as error:  # PIL's SyntaxError / OSError / struct.error for a cut or damaged chunk
            raise OSError(f"truncated or corrupt PNG ({error})") from None
    elif image.format == "JPEG":
        stream = source if isinstance(source, io.BytesIO) else None
        if stream is None:
            with open(source, "rb") as file:
                file.seek(max(0, os.path.getsize(source) - 64))
                tail = file.read()
        else:
            tail = stream.getbuffer()[-64:].tobytes()
        if not tail.rstrip(b"\x00\r\n ").endswith(b"\xff\xd9"):
            raise OSError("truncated JPEG: no end-of-image marker")
    else:
        image.load()


def _open_clip(value, base_dir: Path, column: str, num_frames: int, decode: bool = True) -> Optional[np.ndarray]:
    """A path to an mp4 file or a frame folder (relative to `base_dir` or absolute) -> its
    uint8 frames (F, H, W, 3), which must number `num_frames`; without `decode`, its frames are
    counted only (None)."""
    from omni.videos import VideoError, count_frames, read_frames

    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, (str, os.PathLike)):
        raise BadRow(
            f"column '{column}' holds a {type(value).__name__}, not a video path (an mp4 file or a frame folder)"
        )
    path = Path(value).expanduser()
    source = path if path.is_absolute() else base_dir / path
    try:
        frames = read_frames(source) if decode else None
        count = len(frames) if decode else count_frames(source)
    except VideoError as error:
        raise BadRow(f"column '{column}': {error}") from error
    if count != num_frames:
        raise BadRow(
            f"video {source} in column '{column}' has {count} frames; the run's clips have "
            f"rollout.num_frames={num_frames}"
        )
    return frames


def _open_media(value, base_dir: Path, column: str, num_frames: Optional[int], decode: bool = True):
    if num_frames is None:
        return _open_image(value, base_dir, column, decode)
    return _open_clip(value, base_dir, column, num_frames, decode)


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


def _columns(row) -> Tuple[str, str, str]:
    """(prompt, chosen, rejected) column names of a row in either layout; raises BadRow or TiedRow."""
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with columns, got a {type(row).__name__}")
    if "jpg_0" in row or "label_0" in row:
        _require_columns(row, PICKAPIC_COLUMNS)
        label = _pickapic_label(row["label_0"])
        if label == 0.5:
            raise TiedRow()
        return ("caption", "jpg_0", "jpg_1") if label == 1.0 else ("caption", "jpg_1", "jpg_0")
    _require_columns(row, STANDARD_COLUMNS)
    return "prompt", "chosen", "rejected"


def check_row(row, base_dir: Path, num_frames: Optional[int] = None, edit: Optional[bool] = None) -> None:
    """Raise BadRow or TiedRow for a row that cannot become a pair; images are checked whole (PNG, JPEG: not decoded)
    (clips: their frame counts, see `omni.videos.count_frames`). `edit`: whether the model edits,
    so each pair must name its source image(s) (True) or none (False); None: either."""
    prompt, chosen, rejected = _columns(row)
    _edit_prompt(row, prompt, base_dir, edit)
    _open_media(row[chosen], base_dir, chosen, num_frames, decode=False)
    _open_media(row[rejected], base_dir, rejected, num_frames, decode=False)


def decode_row(row, base_dir: Path, num_frames: Optional[int] = None) -> PreferencePair:
    """One row in either layout -> a pair with decoded images (clips of `num_frames` frames);
    an edit's prompt is a `Prompt` with its source images; raises BadRow or TiedRow."""
    prompt, chosen, rejected = _columns(row)
    return PreferencePair(
        prompt=_edit_prompt(row, prompt, base_dir),
        chosen=_open_media(row[chosen], base_dir, chosen, num_frames),
        rejected=_open_media(row[rejected], base_dir, rejected, num_frames),
    )


def _edit_prompt(row: dict, column: str, base_dir: Path, edit: Optional[bool] = None) -> str:
    """The row's prompt: its text, or for an edit pair (a source column, `SOURCE_COLUMNS`)
    a `Prompt` carrying the source files."""
    text = _prompt(row[column], column)
    try:
        sources, _ = source_paths(row, base_dir, image_store())
    except BadImage as error:
        raise BadRow(str(error)) from None
    if edit is True and not sources:
        raise BadRow(
            f"the model edits images: a pair needs its source image in one of the columns {list(SOURCE_COLUMNS)}"
        )
    if edit is False and sources:
        raise BadRow("the pair names source images but the model makes images from text: train an edit family")
    return Prompt(text, images=sources) if sources else text


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


def _square(image, resolution: int) -> np.ndarray:
    """A PIL image, or a clip's uint8 frames (F, H, W, 3), resized and centre-cropped."""
    if isinstance(image, np.ndarray):
        return np.stack([_square(Image.fromarray(frame), resolution) for frame in image])
    return np.asarray(_resize_and_center_crop(image.convert("RGB"), resolution), dtype=np.uint8)


def images_to_uint8(images: Sequence, resolution: int) -> torch.Tensor:
    """PIL images -> uint8 pixels (B, resolution, resolution, 3), resized and centre-cropped;
    clips (uint8 frames (F, H, W, 3) each) -> (B, F, resolution, resolution, 3)."""
    if not len(images):
        raise ValueError("images_to_tensor needs at least one image")
    return torch.from_numpy(np.stack([_square(im, resolution) for im in images]))


def uint8_to_batch(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (B, H, W, 3) -> float32 (B, 3, H, W) in [0, 1] (clips: (B, F, H, W, 3) ->
    (B, F, 3, H, W)). The batch stays channels-last in memory: the CPU's convolutions take it
    fastest, and the VAE's numbers depend (by rounding) on the layout, so every path hands it
    the same one."""
    return pixels.movedim(-1, -3).float().div(255.0)


def images_to_tensor(images: Sequence[Image.Image], resolution: int) -> torch.Tensor:
    """PIL images -> a float32 batch (B, 3, resolution, resolution) in [0, 1]
    (map to [-1, 1] with 2x - 1 before a VAE that expects it)."""
    return uint8_to_batch(images_to_uint8(images, resolution))
