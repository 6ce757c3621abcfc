"""A synthetic preference set in which the chosen image is always the brighter one, for tests,
tiny end-to-end runs and the data benchmark (`scripts/make_preference_pairs.py`).

Each pair is one smooth random image made lighter (chosen) and darker (rejected) by the
same amount, so brightness is the only difference a model can learn from. (Two unrelated
images, one light and one dark, can be told apart by anything else they differ in, and a
model trained on them learns to tell them apart rather than to make images brighter.)

Two layouts of the same pairs: image files under images/ with `pairs.jsonl` naming them, or
parquet shards with the image bytes embedded (`pairs-00000.parquet`, ...). Images are PNG, or
JPEG (quality 90) as Pick-a-Pic stores them: at Pick-a-Pic's size (`resolution=512`) each is
decoded and resized to the training resolution whenever a pair is read, as real data is (the
images stay smooth, so a JPEG decodes faster than a photograph would). The same arguments
always write the same pairs; images are made a chunk at a time, so a large set needs little
memory.

Scene pairs (`write_scene_pairs`, the compositional task of omni.scenes): for a training
prompt, the chosen image is its scene and the rejected one a scene that fails it in the
requirement its category tests (`omni.scenes.corrupt`), drawn from the same layout seed.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

CHUNK = 512  # pairs made at a time
BRIGHTNESS_GAP = 0.1  # added to every pixel of the chosen image, taken from the rejected one
# format: (PIL's name, file suffix, save options)
IMAGE_FORMATS = {"png": ("PNG", ".png", {}), "jpeg": ("JPEG", ".jpg", {"quality": 90})}


def _smooth(coarse: torch.Tensor, resolution: int) -> torch.Tensor:
    """Coarse 4x4 colour grids upsampled to smooth RGB images in [0, 1]."""
    return F.interpolate(coarse, size=(resolution, resolution), mode="bilinear", align_corners=False).clamp(0, 1)


def _encode(image: torch.Tensor, image_format: str) -> bytes:
    pixels = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    name, _, options = IMAGE_FORMATS[image_format]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=name, **options)
    return buffer.getvalue()


def _pairs(n_pairs: int, resolution: int, seed: int, prompts: Sequence[str], image_format: str):
    """(index, prompt, chosen image bytes, rejected image bytes) for each pair, in order."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompts), generator=generator).tolist() * math.ceil(n_pairs / len(prompts))
    coarse = torch.rand(n_pairs, 3, 4, 4, generator=generator)
    for start in range(0, n_pairs, CHUNK):
        # pixel values in [gap, 1 - gap], so neither side is clipped
        image = BRIGHTNESS_GAP + (1 - 2 * BRIGHTNESS_GAP) * _smooth(coarse[start : start + CHUNK], resolution)
        for offset in range(len(image)):
            i = start + offset
            chosen, rejected = image[offset] + BRIGHTNESS_GAP, image[offset] - BRIGHTNESS_GAP
            yield i, prompts[order[i]], _encode(chosen, image_format), _encode(rejected, image_format)


def _write_jsonl(out_dir: Path, pairs, suffix: str) -> Path:
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "pairs.jsonl"
    with jsonl.open("w", encoding="utf-8") as lines:
        for i, prompt, chosen, rejected in pairs:
            names = {side: f"images/pair_{i:05d}_{side}{suffix}" for side in ("chosen", "rejected")}
            (out_dir / names["chosen"]).write_bytes(chosen)
            (out_dir / names["rejected"]).write_bytes(rejected)
            lines.write(json.dumps({"prompt": prompt, **names}) + "\n")
    return jsonl


def _write_parquet(out_dir: Path, pairs, shard_size: int, row_group_size: int) -> Path:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError("writing parquet shards needs pyarrow: pip install pyarrow") from error
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = {"prompt": [], "chosen": [], "rejected": []}
    shard = 0

    def flush():
        nonlocal shard
        pq.write_table(pa.table(columns), out_dir / f"pairs-{shard:05d}.parquet", row_group_size=row_group_size)
        shard += 1
        for values in columns.values():
            values.clear()

    for _, prompt, chosen, rejected in pairs:
        for name, value in zip(columns, (prompt, chosen, rejected)):
            columns[name].append(value)
        if len(columns["prompt"]) == shard_size:
            flush()
    if columns["prompt"]:
        flush()
    return out_dir


def write_synthetic_pairs(
    out_dir: str | os.PathLike,
    n_pairs: int,
    resolution: int = 64,
    seed: int = 0,
    prompts: Optional[Sequence[str]] = None,
    layout: str = "jsonl",
    shard_size: int = 5000,
    row_group_size: int = 64,
    image_format: str = "png",
) -> Path:
    """Write `n_pairs` pairs and return what to give `data.pairs`: the JSONL file (layout
    "jsonl") or the folder of parquet shards of `shard_size` rows (layout "parquet").

    Each chosen image is its rejected one with every pixel `2 * BRIGHTNESS_GAP` lighter (up to
    JPEG's rounding with `image_format="jpeg"`).
    Prompts default to the colors_train set, taken in a seeded order."""
    if n_pairs < 1 or resolution < 1:
        raise ValueError(f"n_pairs and resolution must be positive, got {n_pairs} and {resolution}")
    if layout not in ("jsonl", "parquet"):
        raise ValueError(f"layout must be 'jsonl' or 'parquet', got {layout!r}")
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image_format must be one of {', '.join(IMAGE_FORMATS)}, got {image_format!r}")
    if prompts is None:
        from omni.data.prompts import load_prompts

        prompts = load_prompts("omni:colors_train")
    pairs = _pairs(n_pairs, resolution, seed, prompts, image_format)
    if layout == "jsonl":
        return _write_jsonl(Path(out_dir), pairs, IMAGE_FORMATS[image_format][1])
    return _write_parquet(Path(out_dir), pairs, shard_size, row_group_size)


def write_synthetic_video_pairs(
    out_dir: str | os.PathLike,
    n_pairs: int,
    resolution: int = 32,
    num_frames: int = 5,
    seed: int = 0,
    prompts: Optional[Sequence[str]] = None,
    fps: int = 8,
) -> Path:
    """The video form of the set, for a video model's DPO: each pair's chosen clip is its
    rejected one `2 * BRIGHTNESS_GAP` lighter; a clip is one smooth image panning right a
    pixel a frame. Even pairs are mp4 files, odd pairs folders of PNG frames (both forms a
    row may name); returns the JSONL file."""
    from omni.videos import write_mp4

    if prompts is None:
        from omni.data.prompts import load_prompts

        prompts = load_prompts("omni:colors_train")
    out_dir = Path(out_dir)
    (out_dir / "clips").mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n_pairs, 3, 4, 4, generator=generator)
    wide = BRIGHTNESS_GAP + (1 - 2 * BRIGHTNESS_GAP) * _smooth(coarse, resolution + num_frames)
    jsonl = out_dir / "pairs.jsonl"
    with jsonl.open("w", encoding="utf-8") as lines:
        for i in range(n_pairs):
            clip = torch.stack([wide[i, :, :resolution, t : t + resolution] for t in range(num_frames)])
            names = {}
            for side, sign in (("chosen", 1), ("rejected", -1)):
                frames = clip + sign * BRIGHTNESS_GAP
                if i % 2 == 0:
                    names[side] = f"clips/pair_{i:05d}_{side}.mp4"
                    write_mp4(out_dir / names[side], frames, fps)
                else:
                    names[side] = f"clips/pair_{i:05d}_{side}"
                    (out_dir / names[side]).mkdir(exist_ok=True)
                    for t, frame in enumerate(frames):
                        (out_dir / names[side] / f"{t:04d}.png").write_bytes(_encode(frame, "png"))
            lines.write(json.dumps({"prompt": prompts[i % len(prompts)], **names}) + "\n")
    return jsonl


def _scene_pairs(n_pairs: int, resolution: int, seed: int, image_format: str):
    """(index, prompt, chosen image bytes, rejected image bytes) for each scene pair, in order:
    the training prompts in a seeded order, again and again."""
    from omni import scenes
    from omni.data.prompt_sets import load_prompt_set

    rng = np.random.default_rng(seed)
    prompts = load_prompt_set("omni:scenes_train")
    order = rng.permutation(len(prompts)).tolist() * math.ceil(n_pairs / len(prompts))
    for i in range(n_pairs):
        item, layout_seed = prompts[order[i]].metadata, int(rng.integers(2**31))
        chosen = scenes.render(item, resolution, layout_seed)
        rejected = scenes.render(scenes.corrupt(item, rng), resolution, layout_seed)
        yield i, str(prompts[order[i]]), _encode(chosen, image_format), _encode(rejected, image_format)


def write_scene_pairs(
    out_dir: str | os.PathLike, n_pairs: int, resolution: int = 64, seed: int = 0, image_format: str = "png"
) -> Path:
    """Write `n_pairs` scene pairs (the shipped training prompts, `omni:scenes_train`, in a
    seeded order) as image files and `pairs.jsonl`; returns the JSONL file, for `data.pairs`."""
    if n_pairs < 1 or resolution < 1:
        raise ValueError(f"n_pairs and resolution must be positive, got {n_pairs} and {resolution}")
    pairs = _scene_pairs(n_pairs, resolution, seed, image_format)
    return _write_jsonl(Path(out_dir), pairs, IMAGE_FORMATS[image_format][1])
