"""Prompt sets: loading a text file (one prompt a line) and a seeded, resumable order.

The order is a function of (seed, step) alone: each epoch is a seeded permutation and step k
takes the next `n` prompts of the endless sequence of epochs, so a resumed run needs only
its step number to continue with exactly the prompts it would have seen.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import List, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)
PACKAGE_PREFIX = "omni:"
T = TypeVar("T")


def resolve_prompt_file(spec: str, key: str) -> Path:
    if spec.startswith(PACKAGE_PREFIX):
        name = spec[len(PACKAGE_PREFIX) :]
        path = Path(str(resources.files("omni") / "assets" / f"{name}.txt"))
        if not path.is_file():
            raise FileNotFoundError(f"{key}={spec}: no prompt set '{name}' ships with omni")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{key}={spec}: prompt file not found (one prompt a line)")
    return path


def load_prompts(spec: str, key: str = "data.train", skip_bad_rows: bool = False) -> List[str]:
    """Non-empty stripped lines of the file; an empty file, or a line that is not UTF-8
    (unless `skip_bad_rows`, which skips and logs it), is an error naming the file and line."""
    path = resolve_prompt_file(spec, key)
    prompts = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as error:
            message = f"{key}={spec}: {path}, line {number}: not UTF-8 text ({error.reason} at byte {error.start})"
            if not skip_bad_rows:
                raise ValueError(message) from None
            logger.warning("skipping a prompt: %s", message)
            continue
        if line:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{key}={spec}: the prompt file {path} has no prompts")
    return prompts


def items_for_step(items: Sequence[T], step: int, n: int, seed: int) -> List[T]:
    """The `n` items (prompts, pair indices) of training step `step` (0-based)."""
    picked, orders = [], {}
    for position in range(step * n, (step + 1) * n):
        epoch, index = divmod(position, len(items))
        if epoch not in orders:
            orders[epoch] = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        picked.append(items[int(orders[epoch][index])])
    return picked
