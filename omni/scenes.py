"""Compositional scenes and their prompts, in GenEval's six categories, drawn procedurally.

A scene is a few flat shapes (`SHAPES`) in GenEval's colours (`COLORS`) on a mid-grey
background. Its prompt carries GenEval's evaluation metadata, the JSONL form `data=geneval`
reads: `tag` (single_object, two_object, counting, colors, position, color_attr), `include`
(one entry per class: `class`, `count`, optional `color`, optional `position` as
[relation, index of an earlier entry]) and, for counting, `exclude` (`class`, `count`: fewer
than that many). The prompt text is written from the metadata, with GenEval's templates.

    sample_metadata(rng, tag)      one random prompt of a category
    prompt_set(n, seed)            n prompts, the categories in turn (the shipped sets)
    render(metadata, size, seed)   an image (3, size, size) in [0, 1] that satisfies it
    corrupt(metadata, rng)         metadata of a scene that fails the prompt (a DPO pair's
                                   rejected image)
    metadata_problem(metadata)     what makes metadata unrenderable (outside the vocabulary,
                                   malformed), or None; validation names the file and line

Everything is a function of its seed. Shapes are drawn 4x supersampled and averaged, so their
edges are anti-aliased, and sized relative to the image, so a scene reads the same at 32 and
64 pixels. Objects keep a gap between their bounding boxes, so none touch.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

SHAPES = ("circle", "square", "triangle", "diamond", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "diamond": "diamonds", "cross": "crosses"}
# GenEval's ten colours, as RGB in [0, 1], chosen far apart and far from the background.
COLORS = {
    "red": (0.86, 0.10, 0.10),
    "orange": (1.00, 0.55, 0.05),
    "yellow": (0.95, 0.90, 0.10),
    "green": (0.10, 0.65, 0.15),
    "blue": (0.10, 0.25, 0.90),
    "purple": (0.55, 0.15, 0.75),
    "pink": (1.00, 0.60, 0.80),
    "brown": (0.45, 0.25, 0.05),
    "black": (0.05, 0.05, 0.05),
    "white": (0.97, 0.97, 0.97),
}
BACKGROUND = (0.5, 0.5, 0.5)
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
MAX_COUNT = 4  # objects of one class
MAX_OBJECTS = 4  # objects in a scene
SUPERSAMPLE = 4
CROSS_ARM = 0.36  # half-width of a cross's arms, as a share of its half-size
# Object size (bounding-box side) as a share of the image side: (fewest objects, most objects).
SIZES = {1: (0.26, 0.36), 2: (0.22, 0.30), 3: (0.18, 0.24), 4: (0.18, 0.24)}
GAP = 0.06  # least distance between two objects' boxes, as a share of the side
MARGIN = 0.04  # least distance from an object's box to the image's edge
ENTRY_KEYS = {"class", "count", "color", "position"}
# Every word a scene prompt can have, for a tokenizer that gives each its own token.
WORDS = tuple(
    dict.fromkeys(
        "a an photo of and".split()
        + list(COUNT_WORDS.values())
        + list(SHAPES)
        + list(PLURALS.values())
        + list(COLORS)
        + " ".join(RELATIONS).split()
    )
)


# ---- metadata -> prompt text ----------------------------------------------------------------


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun(entry: Dict[str, Any]) -> str:
    """'a red circle', 'three circles'."""
    name, count = entry["class"], entry["count"]
    words = ([entry["color"]] if "color" in entry else []) + [name if count == 1 else PLURALS[name]]
    phrase = " ".join(words)
    return (
        f"{_article(phrase)} {phrase}"
        if count == 1 and entry.get("_article", True)
        else f"{COUNT_WORDS[count]} {phrase}"
    )


def prompt_text(metadata: Dict[str, Any]) -> str:
    """GenEval's template for the metadata ("a photo of a red circle and a blue square")."""
    include, tag = metadata["include"], metadata["tag"]
    if tag == "counting":
        return f"a photo of {_noun({**include[0], '_article': False})}"
    if tag == "position":
        subject, target = include[1], include[0]
        return f"a photo of {_noun(subject)} {subject['position'][0]} {_noun(target)}"
    return "a photo of " + " and ".join(_noun(entry) for entry in include)


# ---- sampling prompts ---------------------------------------------------------------------


def _classes(rng: np.random.Generator, k: int) -> List[str]:
    return [SHAPES[i] for i in rng.choice(len(SHAPES), size=k, replace=False)]


def _colors(rng: np.random.Generator, k: int) -> List[str]:
    names = list(COLORS)
    return [names[i] for i in rng.choice(len(names), size=k, replace=False)]


def sample_metadata(rng: np.random.Generator, tag: str) -> Dict[str, Any]:
    """One random prompt of category `tag`, as GenEval's metadata (with its "prompt")."""
    if tag == "single_object":
        include = [{"class": _classes(rng, 1)[0], "count": 1}]
    elif tag == "two_object":
        include = [{"class": name, "count": 1} for name in _classes(rng, 2)]
    elif tag == "counting":
        name, count = _classes(rng, 1)[0], int(rng.integers(1, MAX_COUNT + 1))
        item = {
            "tag": tag,
            "include": [{"class": name, "count": count}],
            "exclude": [{"class": name, "count": count + 1}],
        }
        return {**item, "prompt": prompt_text(item)}
    elif tag == "colors":
        include = [{"class": _classes(rng, 1)[0], "count": 1, "color": _colors(rng, 1)[0]}]
    elif tag == "position":
        target, subject = _classes(rng, 2)
        relation = RELATIONS[int(rng.integers(len(RELATIONS)))]
        include = [{"class": target, "count": 1}, {"class": subject, "count": 1, "position": [relation, 0]}]
    elif tag == "color_attr":
        include = [{"class": n, "count": 1, "color": c} for n, c in zip(_classes(rng, 2), _colors(rng, 2))]
    else:
        raise ValueError(f"unknown scene category {tag!r}; one of {list(TAGS)}")
    item = {"tag": tag, "include": include}
    return {**item, "prompt": prompt_text(item)}


OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def corrupt(metadata: Dict[str, Any], rng: np.random.Generator) -> Dict[str, Any]:
    """A scene that fails the prompt in one requirement, the one its category tests: another
    class (single object; one of two objects), count, colour or relation (the opposite one),
    or the two colours swapped (colour attribution). Drawn, it is the rejected image of a
    preference pair whose chosen image is the prompt's own scene. Its other keys (the prompt's
    text) are the metadata's."""
    tag, include = metadata["tag"], [dict(entry) for entry in metadata["include"]]
    item: Dict[str, Any] = {"tag": tag, "include": include}
    if tag in ("single_object", "two_object"):
        index = int(rng.integers(len(include)))
        others = [name for name in SHAPES if name not in {entry["class"] for entry in include}]
        include[index]["class"] = others[int(rng.integers(len(others)))]
    elif tag == "counting":
        counts = [c for c in range(1, MAX_COUNT + 1) if c != include[0]["count"]]
        include[0]["count"] = counts[int(rng.integers(len(counts)))]
        item["exclude"] = [{"class": include[0]["class"], "count": include[0]["count"] + 1}]
    elif tag == "colors":
        others = [name for name in COLORS if name != include[0]["color"]]
        include[0]["color"] = others[int(rng.integers(len(others)))]
    elif tag == "position":
        include[1]["position"] = [OPPOSITE[include[1]["position"][0]], include[1]["position"][1]]
    elif tag == "color_attr":
        include[0]["color"], include[1]["color"] = include[1]["color"], include[0]["color"]
    return {**metadata, **item}


def prompt_set(n: int, seed: int, avoid: Sequence[str] = (), avoid_tags: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """`n` prompts, the six categories in turn, from `seed`; a prompt of a tag in `avoid_tags`
    whose text is in `avoid` is drawn again (training prompts disjoint from held-out ones)."""
    rng, avoided, items = np.random.default_rng(seed), set(avoid), []
    for i in range(n):
        tag = TAGS[i % len(TAGS)]
        item = sample_metadata(rng, tag)
        while tag in avoid_tags and item["prompt"] in avoided:
            item = sample_metadata(rng, tag)
        items.append(item)
    return items


def to_jsonl(items: Sequence[Dict[str, Any]]) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


# ---- validating metadata ------------------------------------------------------------------


def _entry_problem(entry: Any, index: int, key: str, earlier: List[Dict[str, Any]]) -> Optional[str]:
    where = f"{key}[{index}]"
    if not isinstance(entry, dict):
        return f"{where} is {entry!r}, not an object with 'class' and 'count'"
    unknown = set(entry) - ENTRY_KEYS
    if unknown or "class" not in entry or "count" not in entry:
        return (
            f"{where}={entry} needs 'class' and 'count' (and may have 'color', 'position'), not "
            f"{sorted(unknown) or 'less'}"
        )
    if entry["class"] not in SHAPES:
        return f"{where}: class {entry['class']!r} is not a scene shape; shapes: {list(SHAPES)}"
    count, top = entry["count"], MAX_COUNT + (key == "exclude")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= top:
        return f"{where}: count {count!r} is not a whole number from 1 to {top}"
    if "color" in entry and entry["color"] not in COLORS:
        return f"{where}: color {entry['color']!r} is not a scene colour; colours: {list(COLORS)}"
    if "position" in entry:
        return _position_problem(entry, where, earlier)
    return None


def _position_problem(entry: Dict[str, Any], where: str, earlier: List[Dict[str, Any]]) -> Optional[str]:
    position = entry["position"]
    if not (
        isinstance(position, list)
        and len(position) == 2
        and isinstance(position[1], int)
        and not isinstance(position[1], bool)
    ):
        return f"{where}: position {position!r} is not [relation, index of an earlier include entry]"
    relation, target = position
    if relation not in RELATIONS:
        return f"{where}: relation {relation!r} is not one of {list(RELATIONS)}"
    if not 0 <= target < len(earlier):
        return f"{where}: position names include[{target}], which is not an earlier entry"
    if entry["count"] != 1 or earlier[target]["count"] != 1:
        return f"{where}: a position relates single objects (count 1 on both sides)"
    return None


def metadata_problem(metadata: Any) -> Optional[str]:
    """Why `metadata` (a prompt's GenEval metadata) cannot be drawn or scored, or None."""
    if not isinstance(metadata, dict) or metadata.get("tag") not in TAGS:
        tag = metadata.get("tag") if isinstance(metadata, dict) else None
        return f"a 'tag' among {list(TAGS)} (it has {tag!r})"
    include, exclude = metadata.get("include"), metadata.get("exclude", [])
    if not isinstance(include, list) or not include:
        return f"a non-empty 'include' list of objects (it has {include!r})"
    if not isinstance(exclude, list):
        return f"'exclude' as a list of objects (it has {exclude!r})"
    for key, entries in (("include", include), ("exclude", exclude)):
        for index, entry in enumerate(entries):
            problem = _entry_problem(entry, index, key, include[:index] if key == "include" else [])
            if problem:
                return problem
    return _scene_problem(include, exclude)


def _scene_problem(include: List[Dict[str, Any]], exclude: List[Dict[str, Any]]) -> Optional[str]:
    names = [entry["class"] for entry in include]
    if len(set(names)) < len(names):
        return f"each class once in 'include' (it has {names})"
    total = sum(entry["count"] for entry in include)
    if total > MAX_OBJECTS:
        return f"at most {MAX_OBJECTS} objects in a scene (the include counts sum to {total})"
    counts = dict(zip(names, (entry["count"] for entry in include)))
    for entry in exclude:
        if counts.get(entry["class"], 0) >= entry["count"]:
            return (
                f"an exclude that the include allows (include {counts[entry['class']]} {entry['class']}, exclude "
                f"{entry['count']} or more)"
            )
    return None


# ---- relations (GenEval's) -----------------------------------------------------------------

POSITION_THRESHOLD = 0.1  # GenEval's: the share of both boxes' sides an offset must exceed


def relative_position(box_a: Sequence[float], box_b: Sequence[float]) -> set:
    """Where box A (x0, y0, x1, y1) lies relative to box B, as GenEval's evaluation computes it:
    the centre offset, shrunk by a tenth of both boxes' sides on each axis, names a relation
    when it points within 60 degrees of that direction (y grows downwards)."""
    a, b = np.asarray(box_a, dtype=float).reshape(2, 2), np.asarray(box_b, dtype=float).reshape(2, 2)
    offset = a.mean(axis=0) - b.mean(axis=0)
    dims = np.abs(np.diff(a, axis=0))[0] + np.abs(np.diff(b, axis=0))[0]
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    found = {"left of": dx < -0.5, "right of": dx > 0.5, "above": dy < -0.5, "below": dy > 0.5}
    return {relation for relation, holds in found.items() if holds}


# ---- placing and drawing ------------------------------------------------------------------

Box = Tuple[float, float, float]  # centre x, centre y, side (pixels)


def _objects(metadata: Dict[str, Any], rng: np.random.Generator) -> List[Tuple[str, str, int]]:
    """(shape, colour, include index) of each object; an object without a colour gets a random one."""
    names = list(COLORS)
    return [
        (entry["class"], entry.get("color") or names[int(rng.integers(len(names)))], index)
        for index, entry in enumerate(metadata["include"])
        for _ in range(entry["count"])
    ]


def _apart(box: Box, others: Sequence[Box], gap: float) -> bool:
    x, y, s = box
    return all(max(abs(x - ox) - (s + os) / 2, abs(y - oy) - (s + os) / 2) >= gap for ox, oy, os in others)


def _inside(box: Box, size: int) -> bool:
    x, y, s = box
    low, high = MARGIN * size + s / 2, size - MARGIN * size - s / 2
    return low <= x <= high and low <= y <= high


def _related_box(rng: np.random.Generator, target: Box, side: float, relation: str, size: int) -> Box:
    """A box `relation` the target: along the relation's axis at least a gap away, across it
    within a tenth of the image, so GenEval's relative position holds clearly."""
    tx, ty, ts = target
    along = (ts + side) / 2 + GAP * size + rng.uniform(0, 0.3) * size
    across = rng.uniform(-0.1, 0.1) * size
    dx, dy = {
        "left of": (-along, across),
        "right of": (along, across),
        "above": (across, -along),
        "below": (across, along),
    }[relation]
    return tx + dx, ty + dy, side


def _next_box(rng, metadata, boxes, first_of, index, side, size) -> Optional[Box]:
    """A box for the next object (of include entry `index`) that fits among `boxes`, or None."""
    position = metadata["include"][index].get("position")
    for _ in range(100):
        if position:
            box = _related_box(rng, boxes[first_of[position[1]]], side, position[0], size)
        else:
            box = (rng.uniform(0, size), rng.uniform(0, size), side)
        if _inside(box, size) and _apart(box, boxes, GAP * size):
            return box
    return None


def place(
    metadata: Dict[str, Any], objects: List[Tuple[str, str, int]], size: int, rng: np.random.Generator
) -> List[Box]:
    """A box per object, inside the image, apart from each other, positions as the metadata says."""
    low, high = SIZES[len(objects)]
    for _ in range(100):
        boxes: List[Box] = []
        first_of: Dict[int, int] = {}
        for k, (_, _, index) in enumerate(objects):
            box = _next_box(rng, metadata, boxes, first_of, index, rng.uniform(low, high) * size, size)
            if box is None:
                break
            first_of.setdefault(index, k)
            boxes.append(box)
        if len(boxes) == len(objects):
            return boxes
    raise RuntimeError(f"no layout found for {metadata.get('prompt', metadata)} at {size} px")


def shape_mask(shape: str, box: Box, xx: np.ndarray, yy: np.ndarray) -> np.ndarray:
    """Which points (xx, yy) the shape covers, its bounding box of side s centred at (x, y)."""
    x, y, s = box
    h, dx, dy = s / 2, xx - x, yy - y
    if shape == "circle":
        return dx**2 + dy**2 <= h**2
    if shape == "square":
        return (np.abs(dx) <= 0.85 * h) & (np.abs(dy) <= 0.85 * h)
    if shape == "triangle":  # pointing up, apex at the top of its box
        return (np.abs(dy) <= h) & (np.abs(dx) <= (dy + h) / 2)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= h
    if shape == "cross":
        arm = CROSS_ARM * h
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= h)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= h))
    raise ValueError(f"unknown shape {shape!r}; shapes: {list(SHAPES)}")


def draw(objects: Sequence[Tuple[str, str, int]], boxes: Sequence[Box], size: int) -> torch.Tensor:
    """The image (3, size, size), each shape anti-aliased by 4x supersampling."""
    fine = size * SUPERSAMPLE
    coords = (np.arange(fine) + 0.5) / SUPERSAMPLE
    xx, yy = np.meshgrid(coords, coords)
    canvas = np.empty((fine, fine, 3))
    canvas[:] = BACKGROUND
    for (shape, color, _), box in zip(objects, boxes):
        x, y, s = box  # only the fine pixels of the box (and one more) can be covered
        r0, r1 = (
            (max(int((v - s / 2) * SUPERSAMPLE) - 1, 0) for v in (y, x)),
            (int((v + s / 2) * SUPERSAMPLE) + 2 for v in (y, x)),
        )
        (y0, x0), (y1, x1) = r0, r1
        part = canvas[y0:y1, x0:x1]
        part[shape_mask(shape, box, xx[y0:y1, x0:x1], yy[y0:y1, x0:x1])] = COLORS[color]
    image = canvas.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE, 3).mean(axis=(1, 3))
    return torch.from_numpy(image.transpose(2, 0, 1).copy()).float()


def layout(metadata: Dict[str, Any], size: int, seed: int) -> List[Tuple[str, str, Box]]:
    """The scene's objects: (shape, colour, box) each, a function of the metadata and seed."""
    problem = metadata_problem(metadata)
    if problem:
        raise ValueError(
            f"cannot draw {metadata.get('prompt', metadata) if isinstance(metadata, dict) else metadata!r}: it "
            f"needs {problem}"
        )
    rng = np.random.default_rng(seed)
    objects = _objects(metadata, rng)
    boxes = place(metadata, objects, size, rng)
    return [(shape, color, box) for (shape, color, _), box in zip(objects, boxes)]


def render(metadata: Dict[str, Any], size: int = 64, seed: int = 0) -> torch.Tensor:
    """An image (3, size, size) in [0, 1] of a scene that satisfies the metadata."""
    scene = layout(metadata, size, seed)
    return draw([(shape, color, 0) for shape, color, _ in scene], [box for _, _, box in scene], size)


# ---- the shipped prompt sets --------------------------------------------------------------

HELD_OUT = {"n": 300, "seed": 1}  # omni/assets/scenes_eval.jsonl: 50 prompts a category
# Colour attribution has 1,800 distinct prompts: its held-out ones never appear in training,
# so the held-out set measures whether attribute binding generalises; the other categories
# are too small (5 single-object prompts) to hold any out.
DISJOINT_TAGS = ("color_attr",)


def held_out_prompts() -> List[Dict[str, Any]]:
    return prompt_set(**HELD_OUT)


def training_prompts(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    """`n` training prompts from `seed`, none of the held-out colour-attribution prompts."""
    return prompt_set(n, seed, avoid=[item["prompt"] for item in held_out_prompts()], avoid_tags=DISJOINT_TAGS)


def jitter(
    images: torch.Tensor, seed: int, noise: float = 0.03, blur: float = 1.0, color: float = 0.08
) -> torch.Tensor:
    """Images (B, 3, H, W) as a camera or a decoder might spoil them, from `seed`: a Gaussian
    blur of sigma up to `blur` pixels, each channel's gain and offset off by up to `color`
    (and `color` / 2), Gaussian noise of std `noise`; clamped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    b = images.shape[0]
    sigma = torch.rand(b, generator=g) * blur
    radius = max(1, int(np.ceil(2 * blur)))
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernels = torch.exp(-(offsets[None] ** 2) / (2 * sigma[:, None].clamp_min(1e-3) ** 2))
    kernels = kernels / kernels.sum(dim=1, keepdim=True)
    out = torch.nn.functional.pad(images, (radius,) * 4, mode="replicate")
    out = torch.stack([_separable(image, kernel) for image, kernel in zip(out, kernels)])
    gain = 1 + (torch.rand(b, 3, 1, 1, generator=g) * 2 - 1) * color
    offset = (torch.rand(b, 3, 1, 1, generator=g) * 2 - 1) * color / 2
    out = out * gain + offset + torch.randn(out.shape, generator=g) * noise
    return out.clamp(0, 1)


def _separable(image: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """A padded image (3, H + 2r, W + 2r) blurred by a 1-D kernel (2r + 1) along both axes."""
    k = kernel.view(1, 1, 1, -1).expand(3, 1, 1, -1)
    rows = torch.nn.functional.conv2d(image[None], k, groups=3)
    return torch.nn.functional.conv2d(rows, k.transpose(2, 3), groups=3)[0]
