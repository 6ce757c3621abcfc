"""GenEval's score on scene images (`reward=scene_geneval`), read from the pixels: no model.

Finding the objects (`detect`), for a batch of images (B, 3, H, W) in [0, 1]:
1. white balance: each channel is scaled so that the image's median colour (its background,
   which covers most of a scene) becomes the renderer's grey;
2. foreground: pixels farther than `foreground` from that grey, opened (eroded, then dilated)
   by one pixel to drop speckles of noise;
3. connected components (8-connected) by propagating the largest pixel index through each
   component (a 3x3 max-pool, then a jump to the label a label names, repeated until nothing
   changes);
4. per component: its colour is the scene colour nearest to its median pixel (after an
   erosion, so that blurred edges do not vote); its coverage of each pixel is the pixel's
   share of that colour against the grey; its shape is the scene shape that, drawn with the
   same total coverage and centroid (both survive a blur) and blurred by 0, 0.6 or 1.2 px,
   leaves the coverage nearest to the component's;
   its box and centroid are kept for positions. A component counts as an object only if
   both fit (`shape_fit`, `color_fit`) and its area lies within [min_area, max_area], as
   GenEval counts only its detector's confident boxes: noise and smears are not objects.

Scoring (`evaluate`) follows GenEval's evaluation on the prompt's metadata: each `include`
entry needs at least `count` objects of its class, of its colour if it names one, and
`position` [relation, i] needs each of them to stand in that relation to the objects that
matched entry i (GenEval's `relative_position` on the boxes); each `exclude` entry needs
fewer than `count` objects of its class. The image scores 1 if every requirement holds,
else 0 (GenEval's accuracy); the dense score is the share of requirements met (counts,
colours, positions, exclusions each one), a gradient for training. `dense` chooses which
one is the reward; both are logged (reward/scene_geneval/accuracy, .../partial).

Where GenEval keeps a detector's most confident boxes, this keeps, of a class, the objects of
the required colour first, then the largest. Prompts need GenEval metadata inside the
renderer's vocabulary (omni.scenes); anything else fails at validation, naming the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from omni import scenes
from omni.rewards.base import Reward, RewardOptions


@dataclass
class SceneGenevalOptions(RewardOptions):
    # The reward: the share of the prompt's requirements met (True), or GenEval's 0/1 (False).
    dense: bool = True
    # Least RGB distance (0 to sqrt 3) from the background grey for a pixel to be an object.
    foreground: float = 0.2
    # Least and most area of an object, as a share of the image (others are noise or background).
    min_area: float = 0.004
    max_area: float = 0.25
    # How well a component must fit its shape (squared error of the best drawn shape over the
    # component's own square; renders fit within 0.03, noise blobs mostly beyond 0.2) ...
    shape_fit: float = 0.1
    # ... and its colour (RGB distance of its median colour to the nearest scene colour) to
    # count as an object, as GenEval counts only a detector's confident boxes.
    color_fit: float = 0.3


# class, color, shape_fit, color_fit, box (x0, y0, x1, y1), centroid (x, y), area (pixels)
Detection = Dict[str, Any]


PALETTE = torch.tensor(list(scenes.COLORS.values()))
BACKGROUND = torch.tensor(scenes.BACKGROUND)


def white_balanced(images: torch.Tensor) -> torch.Tensor:
    """Each image's channels scaled so that its median colour becomes the background grey."""
    median = images.flatten(2).median(dim=2).values.clamp_min(0.05)
    gain = (BACKGROUND[None] / median).clamp(0.5, 2.0)
    return (images * gain[:, :, None, None]).clamp(0, 1)


def _erode(mask: torch.Tensor) -> torch.Tensor:
    return -F.max_pool2d(-mask, 3, stride=1, padding=1)


def _dilate(mask: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(mask, 3, stride=1, padding=1)


def components(mask: torch.Tensor) -> torch.Tensor:
    """Labels (B, H, W) of the 8-connected components of a boolean mask (B, H, W): each
    component's largest flat pixel index + 1, 0 off the mask. Each round takes the largest
    label among the neighbours, then the label of the pixel a label names (which lies in the
    same component), so labels travel far in few rounds."""
    b, h, w = mask.shape
    inside = mask[:, None].float()
    labels = torch.arange(1, h * w + 1, dtype=torch.float32).view(1, 1, h, w) * inside
    while True:
        grown = F.max_pool2d(labels, 3, stride=1, padding=1) * inside
        flat = grown.view(b, -1)
        named = torch.gather(flat, 1, (flat.long() - 1).clamp_min(0)).view_as(grown) * inside
        grown = torch.maximum(grown, named)
        if torch.equal(grown, labels):
            return labels[:, 0].long()
        labels = grown


def _shape_moments() -> Dict[str, Tuple[float, float]]:
    """Each shape's area and its centroid's offset below its box's centre, per unit box side."""
    coords = (np.arange(256) + 0.5) / 256 - 0.5
    xx, yy = np.meshgrid(coords, coords)
    moments = {}
    for shape in scenes.SHAPES:
        mask = scenes.shape_mask(shape, (0.0, 0.0, 1.0), xx, yy)
        moments[shape] = (float(mask.mean()), float(yy[mask].mean()))
    return moments


MOMENTS = _shape_moments()
BLURS = (0.0, 0.6, 1.2)  # blur (pixels) each hypothesis is drawn with; the best one counts


def _blur_kernels() -> torch.Tensor:
    """(len(BLURS), 1, 7, 7) Gaussian kernels, the first the identity."""
    offsets = torch.arange(-3, 4, dtype=torch.float64)
    kernels = []
    for sigma in BLURS:
        line = (offsets == 0).double() if sigma == 0 else torch.exp(-(offsets**2) / (2 * sigma**2))
        kernels.append(torch.outer(line, line) / line.sum() ** 2)
    return torch.stack(kernels)[:, None]


KERNELS = _blur_kernels()


def _drawn(shape: str, covered: np.ndarray, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The coverage the shape would leave on the pixels of `covered` (h, w), sized by its
    total coverage and centred on its centroid (both survive a blur), 4x supersampled."""
    total = covered.sum()
    area, below = MOMENTS[shape]
    side = float(np.sqrt(total / area))
    cx, cy = (covered * xs).sum() / total, (covered * ys).sum() / total - below * side
    h, w = covered.shape
    fine = (np.arange(scenes.SUPERSAMPLE * max(h, w)) + 0.5) / scenes.SUPERSAMPLE
    xx, yy = np.meshgrid(fine[: w * scenes.SUPERSAMPLE], fine[: h * scenes.SUPERSAMPLE])
    mask = scenes.shape_mask(shape, (cx, cy, side), xx, yy)
    return mask.reshape(h, scenes.SUPERSAMPLE, w, scenes.SUPERSAMPLE).mean(axis=(1, 3))


def classify_shape(covered: torch.Tensor, window: torch.Tensor) -> Tuple[str, float]:
    """The scene shape that, drawn where the object is at its size (and blurred as much as
    fits best), leaves the coverage (H, W) nearest to the object's within the window; and
    how far it stays (squared error over the coverage's own square: 0 is a perfect fit)."""
    rows, cols = torch.nonzero(window.any(dim=1)).flatten(), torch.nonzero(window.any(dim=0)).flatten()
    r0, r1, c0, c1 = max(int(rows[0]) - 3, 0), int(rows[-1]) + 4, max(int(cols[0]) - 3, 0), int(cols[-1]) + 4
    seen = covered[r0:r1, c0:c1].double().numpy()
    inside = window[r0:r1, c0:c1].double().numpy()
    ys, xs = np.mgrid[0 : seen.shape[0], 0 : seen.shape[1]] + 0.5
    drawn = torch.from_numpy(np.stack([_drawn(shape, seen, ys, xs) for shape in scenes.SHAPES]))
    blurred = F.conv2d(drawn[:, None], KERNELS, padding=3)  # (shapes, blurs, h, w)
    errors = (((blurred - torch.from_numpy(seen)) * torch.from_numpy(inside)) ** 2).sum(dim=(2, 3)).amin(dim=1)
    return scenes.SHAPES[int(errors.argmin())], float(errors.min() / ((seen * inside) ** 2).sum())


def coverage(image: torch.Tensor, color: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """How much of each pixel (H, W) of `window` an object of colour `color` (3,) covers, if
    pixels mix it with the background grey: the projection of pixel - grey on colour - grey."""
    direction = color - BACKGROUND
    share = torch.einsum(
        "chw,c->hw", image - BACKGROUND[:, None, None], direction
    ) / direction.square().sum().clamp_min(1e-6)
    return share.clamp(0, 1) * window


def describe(image: torch.Tensor, region: torch.Tensor, core: torch.Tensor) -> Detection:
    """A component's class, colour, box, centroid and area, from the pixels of its region
    (its median colour taken on its eroded core, so blurred edges do not vote)."""
    color = image[:, core if core.any() else region].T.median(dim=0).values
    window = _dilate(region[None, None].float())[0, 0]
    covered = coverage(image, color, window)
    ys, xs = torch.nonzero(covered >= 0.5, as_tuple=True)
    if len(xs) == 0:  # a faint object: its region stands in
        ys, xs = torch.nonzero(region, as_tuple=True)
        covered = region.float()
    shape, shape_fit = classify_shape(covered, window)
    distances = torch.linalg.vector_norm(PALETTE - color, dim=1)
    return {
        "class": shape,
        "color": list(scenes.COLORS)[int(distances.argmin())],
        "shape_fit": shape_fit,
        "color_fit": float(distances.min()),
        "box": (float(xs.min()), float(ys.min()), float(xs.max()) + 1, float(ys.max()) + 1),
        "centroid": (float(xs.float().mean()) + 0.5, float(ys.float().mean()) + 0.5),
        "area": int(region.sum()),
    }


def detect(images: torch.Tensor, options: Optional[SceneGenevalOptions] = None) -> List[List[Detection]]:
    """The objects in each image (B, 3, H, W) in [0, 1]: see the module's docstring."""
    options = options or SceneGenevalOptions()
    images = white_balanced(images.float().clamp(0, 1))
    distance = torch.linalg.vector_norm(images - BACKGROUND[None, :, None, None], dim=1)
    mask = _dilate(_erode((distance > options.foreground).float()[:, None]))
    core = _erode(mask)[:, 0] > 0
    labels = components(mask[:, 0] > 0)
    pixels = images.shape[-1] * images.shape[-2]
    found = []
    for image, label, inner in zip(images, labels, core):
        objects = []
        for value in torch.unique(label[label > 0]).tolist():
            region = label == value
            if options.min_area * pixels <= region.sum() <= options.max_area * pixels:
                objects.append(describe(image, region, region & inner))
        found.append(
            [o for o in objects if o["shape_fit"] <= options.shape_fit and o["color_fit"] <= options.color_fit]
        )
    return found


def _matching(objects: List[Detection], entry: Dict[str, Any]) -> List[Detection]:
    """The entry's class's objects: those of its colour first, then the largest."""
    mine = [o for o in objects if o["class"] == entry["class"]]
    return sorted(mine, key=lambda o: (o["color"] != entry.get("color", o["color"]), -o["area"]))


def _position_met(found: List[Detection], entry: Dict[str, Any], groups: List[Optional[List[Detection]]]) -> bool:
    relation, target = entry["position"]
    if len(found) < entry["count"] or groups[target] is None:
        return False
    return all(relation in scenes.relative_position(o["box"], t["box"]) for o in found for t in groups[target])


def evaluate(objects: List[Detection], metadata: Dict[str, Any]) -> Tuple[bool, int, int]:
    """(GenEval's correct, requirements met, requirements) of an image's objects."""
    met, total, groups = 0, 0, []
    for entry in metadata["include"]:
        found = _matching(objects, entry)[: entry["count"]]
        checks = [len(found) >= entry["count"]]
        if "color" in entry:
            checks.append(sum(o["color"] == entry["color"] for o in found) >= entry["count"])
        if "position" in entry:
            checks.append(_position_met(found, entry, groups))
        groups.append(found if all(checks) else None)
        met, total = met + sum(checks), total + len(checks)
    for entry in metadata.get("exclude", []):
        checks_ok = sum(o["class"] == entry["class"] for o in objects) < entry["count"]
        met, total = met + checks_ok, total + 1
    return met == total, met, total


class SceneGeneval(Reward):
    Options = SceneGenevalOptions

    @classmethod
    def check_options(cls, options: SceneGenevalOptions, key: str) -> None:
        if not 0 < options.foreground < 3**0.5:
            raise ValueError(f"{key}.foreground={options.foreground} must lie between 0 and sqrt(3) (an RGB distance)")
        if not 0 <= options.min_area < options.max_area <= 1:
            raise ValueError(
                f"{key}: min_area={options.min_area} and max_area={options.max_area} are shares of the image, 0 <= "
                "min_area < max_area <= 1"
            )

    @classmethod
    def prompt_problem(cls, options: SceneGenevalOptions, prompt: Any) -> Optional[str]:
        problem = scenes.metadata_problem(getattr(prompt, "metadata", None))
        return f"scene metadata (omni.scenes): {problem}" if problem else None

    def score_details(self, images: torch.Tensor, prompts: List[Any]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        results = [evaluate(objects, prompt.metadata) for objects, prompt in zip(detect(images, self.options), prompts)]
        accuracy = torch.tensor([float(correct) for correct, _, _ in results])
        partial = torch.tensor([met / total for _, met, total in results])
        return (partial if self.options.dense else accuracy), {"accuracy": accuracy, "partial": partial}

    def score(self, images, prompts):
        return self.score_details(images, prompts)[0]


REWARD = SceneGeneval
