"""Prompt sets: loading a prompt file and a seeded, resumable order.

A prompt file is either text (one prompt a line) or JSONL (one object a line: its
"prompt", and the rest is the item's metadata, as GenEval's metadata files lay it out).
Each prompt is a `Prompt`: a str, so tokenizers and engines take it as it is, that also
carries its metadata and origin (file, line) through the rollout to the rewards.

The order is a function of (seed, step) alone: each epoch is a seeded permutation and step k
takes the next `n` prompts of the endless sequence of epochs, so a resumed run needs only
its step number to continue with exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)
PACKAGE_PREFIX = "omni:"
T = TypeVar("T")
JSONL_SUFFIX = ".jsonl"


class Prompt(str):
    """A prompt's text, with its item's `metadata` and its `origin` ("<file>, line <n>")."""

    metadata: Dict[str, Any]
    origin: str

    def __new__(cls, text: str, metadata: Optional[Mapping[str, Any]] = None, origin: str = ""):
        prompt = super().__new__(cls, text)
        prompt.metadata = dict(metadata or {})
        prompt.origin = origin
        return prompt


def resolve_prompt_file(spec: str, key: str) -> Path:
    if spec.startswith(PACKAGE_PREFIX):
        name = spec[len(PACKAGE_PREFIX) :]
        assets = resources.files("omni") / "assets"
        for suffix in (".txt", JSONL_SUFFIX):
            path = Path(str(assets / f"{name}{suffix}"))
            if path.is_file():
                return path
        raise FileNotFoundError(f"{key}={spec}: no prompt set '{name}' ships with omni")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{key}={spec}: prompt file not found (one prompt a line, or JSONL with a 'prompt' field)")
    return path


def parse_item(line: str, jsonl: bool, where: str) -> Prompt:
    """One prompt file line -> a Prompt; a JSONL line must be an object with a string
    'prompt'. Raises ValueError with the reason (the caller adds the file and line)."""
    if not jsonl:
        return Prompt(line, origin=where)
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
        raise ValueError("a JSONL prompt line is an object with a non-empty string 'prompt'")
    text = item.pop("prompt").strip()
    return Prompt(text, item, where)


def load_prompts(spec: str, key: str = "data.train", skip_bad_rows: bool = False) -> List[Prompt]:
    """The file's prompts (non-empty stripped lines); an empty file, or a line that is not
    UTF-8 or not a valid JSONL item (unless `skip_bad_rows`, which skips and logs it), is an
    error naming the file and line."""
    path = resolve_prompt_file(spec, key)
    jsonl = path.suffix == JSONL_SUFFIX
    prompts = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        where = f"{path}, line {number}"
        try:
            line = raw.decode("utf-8").strip()
            if line:
                prompts.append(parse_item(line, jsonl, where))
        except (UnicodeDecodeError, ValueError) as error:
            reason = f"not UTF-8 text ({error.reason} at byte {error.start})" if isinstance(error, UnicodeDecodeError) else str(error)
            message = f"{key}={spec}: {where}: {reason}"
            if not skip_bad_rows:
                raise ValueError(message) from None
            logger.warning("skipping a prompt: %s", message)
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
