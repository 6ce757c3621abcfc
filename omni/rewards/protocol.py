"""The reward server's wire format, shared by the `http` client and `omni.rewards.serve`
(written out for users who bring their own server in docs/reward_server.md).

    GET  /health -> {"ok": true, "reward": [component names]}
    POST /score     {"prompts": [str], "metadata": [object], "images": [base64 PNG]}
                 -> {"scores": [number]}                      one per image, in order

An edit's request also has "sources" ([[base64 image]], each prompt's source images) and
"targets" ([base64 image or null]); the server keeps them as files
(`omni.data.edits.stored_image`) so its rewards read them as they would locally, and the
local path of a target stays out of the metadata sent.

Images cross as 8-bit RGB PNG (lossless for 8-bit data, a few KB each), so the server sees
exactly `quantize(images)`: the in-process reward scores those same values.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from omni.data.image_files import BadImage, image_store, stored_image
from omni.data.prompts import Prompt, source_images


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) in [0, 1] -> (H, W, 3) uint8, rounded as any 8-bit image writer would."""
    return (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)


def quantize(images: torch.Tensor) -> torch.Tensor:
    """The images as the server decodes them (8 bits per channel)."""
    return torch.stack([torch.from_numpy(to_uint8(image)).permute(2, 0, 1).float() / 255 for image in images])


def encode_image(image: torch.Tensor) -> str:
    buffer = io.BytesIO()
    # compress_level 1: PNG stays lossless; the fastest level keeps encoding far below scoring time
    Image.fromarray(to_uint8(image)).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(text: str, index: int) -> torch.Tensor:
    """A base64 PNG -> (3, H, W) float in [0, 1]; ValueError naming the image otherwise."""
    try:
        with Image.open(io.BytesIO(base64.b64decode(text, validate=True))) as image:
            array = np.asarray(image.convert("RGB"))
    except (binascii.Error, OSError, ValueError, TypeError) as error:
        raise ValueError(f"images[{index}] is not a base64 PNG ({error})") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


def score_request(images: torch.Tensor, prompts: Sequence[str]) -> Dict[str, Any]:
    """The body of POST /score for a batch (prompts' metadata, and edits' sources, included)."""
    metadata = [getattr(p, "metadata", {}) for p in prompts]
    body = {
        "prompts": [str(p) for p in prompts],
        "metadata": [{k: v for k, v in m.items() if k != "target"} for m in metadata],
        "images": [encode_image(image) for image in images],
    }
    if any(source_images(p) for p in prompts):
        body["sources"] = [[file_base64(path) for path in source_images(p)] for p in prompts]
        body["targets"] = [file_base64(m["target"]) if "target" in m else None for m in metadata]
    return body


def file_base64(path: str) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _edit_images(body: Dict[str, Any], count: int, store: Path) -> Tuple[List[List[str]], List[Any]]:
    """The request's source and target images as files in `store` (none for a text prompt)."""
    sources, targets = body.get("sources") or [[]] * count, body.get("targets") or [None] * count
    if not isinstance(sources, list) or len(sources) != count or not isinstance(targets, list) or len(targets) != count:
        raise ValueError(f"'sources' and 'targets' must be lists with one entry per prompt ({count})")

    def stored(text: Any, where: str) -> str:
        try:
            return stored_image(base64.b64decode(text, validate=True), Path("."), where, store)
        except (binascii.Error, TypeError, BadImage) as error:
            raise ValueError(f"{where} is not a base64 image ({error})") from None

    files = [[stored(t, f"sources[{i}][{j}]") for j, t in enumerate(s or [])] for i, s in enumerate(sources)]
    return files, [None if t is None else stored(t, f"targets[{i}]") for i, t in enumerate(targets)]


def parse_score_request(body: Any) -> Tuple[torch.Tensor, List[Prompt]]:
    """Server side: the images (B, 3, H, W) and prompts of a request; ValueError says what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the body is a JSON object with 'prompts', 'images' and optionally 'metadata'")
    prompts, images = body.get("prompts"), body.get("images")
    metadata = body.get("metadata") or [{}] * len(prompts or [])
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if not isinstance(images, list) or len(images) != len(prompts) or len(metadata) != len(prompts):
        raise ValueError(f"'images' and 'metadata' must be lists with one entry per prompt ({len(prompts)})")
    if not all(isinstance(m, dict) for m in metadata):
        raise ValueError("'metadata' must be a list of objects")
    decoded = [decode_image(text, i) for i, text in enumerate(images)]
    if len({tuple(image.shape) for image in decoded}) > 1:
        raise ValueError(f"images of one request must share a size; got {sorted({tuple(i.shape) for i in decoded})}")
    batch = torch.stack(decoded) if decoded else torch.zeros(0, 3, 1, 1)
    sources, targets = _edit_images(body, len(prompts), image_store())
    return batch, [
        Prompt(p, {**m, **({"target": t} if t else {})}, f"request prompt {i}", s)
        for i, (p, m, s, t) in enumerate(zip(prompts, metadata, sources, targets))
    ]


def parse_scores(body: Any, expected: int) -> torch.Tensor:
    """Client side: the scores of an answer; ValueError when it is not `expected` numbers."""
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list) or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
        raise ValueError(f'expected {{"scores": [number, ...]}}, got {str(body)[:200]}')
    if len(scores) != expected:
        raise ValueError(f"{len(scores)} scores for {expected} images")
    return torch.tensor(scores, dtype=torch.float32)


def scores_answer(scores: torch.Tensor) -> bytes:
    """Server side: the answer body. A non-finite score travels as NaN / Infinity (which
    Python's json reads), so the client's reward.nonfinite policy sees it, not a made-up number."""
    return json.dumps({"scores": [float(s) for s in scores]}).encode()
