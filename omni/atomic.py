"""Atomic writes: a directory or file appears whole under its final name, or not at all,
so an interrupted save never damages what was there before (checkpoints, model caches,
weights handed to a rollout engine)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def write_directory(final: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of `final` with `write(tmp)`, flush it, then rename it to
    `final`. An older `final` is renamed aside first and removed only once the new one is in
    place, so at every moment one of them is on disk under a name that says which."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        aside = None
        if final.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, aside)
        os.replace(tmp, final)
        if aside is not None:
            shutil.rmtree(aside)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
