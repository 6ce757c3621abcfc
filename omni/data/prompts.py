"""Prompt sets: loading a prompt file and a seeded, resumable order.

A prompt file is one of
- text (.txt or any other suffix): one prompt a line (Flow-GRPO's Pick-a-Pic and OCR sets);
- JSONL (.jsonl): one object a line, its "prompt" and the rest the item's metadata (GenEval's
  metadata files);
- CSV (.csv): a header row naming the prompt column (`prompt`, `prompts` as DrawBench has it,
  or `caption` as Pick-a-Pic has it, in any case); every other named column is metadata,
  keyed by its lower-cased header (DrawBench's `Category` -> metadata["category"]).
Each prompt is a `Prompt`: a str, so tokenizers and engines take it as it is, that also
carries its metadata and origin (file, line) through the rollout to the rewards. A line that
does not fit its file's layout is an error naming the file and line.

The order is a function of (seed, step) alone: each epoch is a seeded permutation and step k
takes the next `n` prompts of the endless sequence of epochs, so a resumed run needs only
its step number to continue with exactly the prompts it would have seen.
"""

from __future__ import annotations

import csv
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar

import torch

from omni import seeding

logger = logging.getLogger(__name__)
PACKAGE_PREFIX = "omni:"
T = TypeVar("T")
JSONL_SUFFIX = ".jsonl"
CSV_SUFFIX = ".csv"
SUFFIXES = (".txt", JSONL_SUFFIX, CSV_SUFFIX)
# Names of a CSV file's prompt column (compared lower-cased): ours, DrawBench's, Pick-a-Pic's.
PROMPT_COLUMNS = ("prompt", "prompts", "caption")


class Prompt(str):
    """A prompt's text, with its item's `metadata`, its `origin` ("<file>, line <n>") and, for
    an edit, its source `images` (files the edit family conditions on, `omni.data.edits`)."""

    metadata: Dict[str, Any]
    origin: str
    images: Tuple[str, ...]

    def __new__(
        cls,
        text: str,
        metadata: Optional[Mapping[str, Any]] = None,
        origin: str = "",
        images: Sequence[str] = (),
    ):
        prompt = super().__new__(cls, text)
        prompt.metadata = dict(metadata or {})
        prompt.origin = origin
        prompt.images = tuple(str(image) for image in images)
        return prompt


def source_images(prompt: str) -> Tuple[str, ...]:
    """The source images an (edit) prompt conditions on; () for a text-to-image prompt."""
    return getattr(prompt, "images", ())


def resolve_prompt_file(spec: str, key: str) -> Path:
    if spec.startswith(PACKAGE_PREFIX):
        name = spec[len(PACKAGE_PREFIX) :]
        assets = resources.files("omni") / "assets"
        for suffix in SUFFIXES:
            path = Path(str(assets / f"{name}{suffix}"))
            if path.is_file():
                return path
        raise FileNotFoundError(f"{key}={spec}: no prompt set '{name}' ships with omni")
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"{key}={spec}: prompt file not found (one prompt a line, JSONL with a 'prompt' field, or CSV with a "
            "prompt column)"
        )
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
    """The file's prompts (non-empty stripped lines, or CSV rows); an empty file, or a line
    that is not UTF-8 or does not fit the file's layout (unless `skip_bad_rows`, which skips
    and logs it), is an error naming the file and line."""
    path = resolve_prompt_file(spec, key)

    def refuse(where: str, reason: str, skippable: bool = True) -> None:
        message = f"{key}={spec}: {where}: {reason}"
        if not (skip_bad_rows and skippable):
            raise ValueError(message) from None
        logger.warning("skipping a prompt: %s", message)

    if path.suffix == CSV_SUFFIX:
        prompts = csv_prompts(path, refuse)
    else:
        prompts = line_prompts(path, path.suffix == JSONL_SUFFIX, refuse)
    if not prompts:
        raise ValueError(f"{key}={spec}: the prompt file {path} has no prompts")
    return prompts


def decoded_lines(path: Path, refuse) -> Iterator[tuple]:
    """(line number, text) of each UTF-8 line; `refuse` hears of the others."""
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as error:
            refuse(f"{path}, line {number}", f"not UTF-8 text ({error.reason} at byte {error.start})")


def line_prompts(path: Path, jsonl: bool, refuse) -> List[Prompt]:
    prompts = []
    for number, line in decoded_lines(path, refuse):
        try:
            if line.strip():
                prompts.append(parse_item(line.strip(), jsonl, f"{path}, line {number}"))
        except ValueError as error:
            refuse(f"{path}, line {number}", str(error))
    return prompts


def csv_prompts(path: Path, refuse) -> List[Prompt]:
    """A CSV file's rows as prompts; the header names the prompt column (`PROMPT_COLUMNS`)."""
    numbers: List[int] = []

    def lines():
        for number, line in decoded_lines(path, refuse):
            numbers.append(number)
            yield line + "\n"  # a quoted field may span lines: the reader keeps its newline

    reader = csv.reader(lines())
    header = [name.strip().lstrip("\ufeff") for name in next(reader, [])]
    lowered = [name.lower() for name in header]
    column = next((i for i, name in enumerate(lowered) if name in PROMPT_COLUMNS), None)
    if column is None:
        where = f"{path}, line {numbers[-1] if numbers else 1}"
        expected = (
            f"a CSV prompt file starts with a header naming its prompt column, one of {list(PROMPT_COLUMNS)} (any case)"
        )
        refuse(where, f"{expected}; the header is {header}", skippable=False)
    prompts, start = [], len(numbers)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as error:  # a field over the csv module's size limit
            refuse(f"{path}, line {numbers[start]}", f"not CSV ({error})", skippable=False)
        where, start = f"{path}, line {numbers[start]}", len(numbers)
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            refuse(where, f"{len(row)} fields where the header has {len(header)} ({header})")
        elif not row[column].strip():
            refuse(where, f"the prompt column '{header[column]}' is empty")
        else:
            metadata = {name: cell.strip() for i, (name, cell) in enumerate(zip(lowered, row)) if i != column and name}
            prompts.append(Prompt(row[column].strip(), metadata, where))
    return prompts


def items_for_step(items: Sequence[T], step: int, n: int, seed: int) -> List[T]:
    """The `n` items (prompts, pair indices) of training step `step` (0-based)."""
    picked, orders = [], {}
    for position in range(step * n, (step + 1) * n):
        epoch, index = divmod(position, len(items))
        if epoch not in orders:
            orders[epoch] = torch.randperm(
                len(items), generator=seeding.seeded_generator(seed, epoch, seeding.EPOCH_ORDER)
            )
        picked.append(items[int(orders[epoch][index])])
    return picked
