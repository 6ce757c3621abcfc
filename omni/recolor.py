"""A toy edit task on the CPU: recolour one shape of a rendered scene.

Each edit is a two-object scene of `omni.scenes` (a source image), an instruction such as
"make the red circle blue", and the target: the same scene, the same layout, with only that
shape recoloured. The `edit_target` and `edit_consistency` rewards score a result against the
target inside the region that changes and against the source outside it, so a tiny edit model
can learn the task from the rewards alone, and a learning test can measure it.

    recolor_edit(rng, size, seed)   one edit: (instruction, source image, target image)
    write_recolor_set(dir, n, seed) an edit set (JSONL and PNGs) `data.train` reads
    write_recolor_pairs(dir, n, seed) edit preference pairs (the edit done over the source
                                    left as it is) for offline DPO, `data.pairs`

The shipped sets (omni/assets/recolor_train.jsonl, recolor_eval.jsonl and their images under
omni/assets/recolor/) are `write_recolor_set`'s output for `SHIPPED`:
    python scripts/make_recolor_edits.py
Everything is a function of its seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
from PIL import Image

from omni import scenes

SIZE = 64
# Shapes and colours whose names the tiny models' tokenizers hold as single tokens
# (omni.models.tiny_parts.TINY_WORDS), so an instruction fits their 16-token context whole.
SHAPES = ("circle", "square")
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "black", "white")
# The shipped sets: name -> (edits, seed). Train and eval draw from the same distribution
# with other seeds (a scene of two coloured shapes has ~1,800 colourings of ~25 shape pairs).
SHIPPED = {"recolor_train": (96, 0), "recolor_eval": (32, 1)}
IMAGE_DIR = "recolor"


def recolor_edit(rng: np.random.Generator, size: int = SIZE, seed: int = 0) -> Tuple[str, torch.Tensor, torch.Tensor]:
    """(instruction, source, target) for one random scene of a circle and a square in two
    colours, one of them recoloured to a third; images (3, size, size)."""
    shapes = [SHAPES[int(i)] for i in rng.permutation(len(SHAPES))]  # a scene names each shape once
    old, other, new = (COLORS[int(i)] for i in rng.permutation(len(COLORS))[:3])
    include = [{"class": shape, "count": 1, "color": color} for shape, color in zip(shapes, (old, other))]
    scene = scenes.layout({"tag": "color_attr", "include": include}, size, seed)
    shape = scene[0][0]
    objects = [(s, c, 0) for s, c, _ in scene]
    boxes = [b for _, _, b in scene]
    source = scenes.draw(objects, boxes, size)
    target = scenes.draw([(shape, new, 0)] + objects[1:], boxes, size)
    return f"make the {old} {shape} {new}", source, target


def to_png(image: torch.Tensor, path: Path) -> None:
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(path, optimize=True)


def write_recolor_set(out_dir: Path, name: str, n: int, seed: int, size: int = SIZE, pairs: bool = False) -> Path:
    """`n` edits as `<out_dir>/<name>.jsonl`, images under `<out_dir>/recolor/` (paths in the
    rows are relative to the JSONL's folder, as edit sets take them); `pairs`: as preference
    pairs instead, the target `chosen` over the unedited source `rejected`."""
    out_dir = Path(out_dir)
    (out_dir / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows: List[Dict[str, str]] = []
    for i in range(n):
        instruction, source, target = recolor_edit(rng, size, seed=seed * 100_003 + i)
        source_path, target_path = (f"{IMAGE_DIR}/{name}-{i:03d}-{kind}.png" for kind in ("source", "target"))
        to_png(source, out_dir / source_path)
        to_png(target, out_dir / target_path)
        if pairs:
            rows.append({"prompt": instruction, "image": source_path, "chosen": target_path, "rejected": source_path})
        else:
            rows.append({"prompt": instruction, "image": source_path, "target": target_path})
    path = out_dir / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_recolor_pairs(out_dir: Path, name: str, n: int, seed: int, size: int = SIZE) -> Path:
    """`write_recolor_set` as preference pairs."""
    return write_recolor_set(out_dir, name, n, seed, size, pairs=True)
