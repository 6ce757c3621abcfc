"""Atomic writes: a directory or file appears whole under its final name, or not at all,
so an interrupted save never damages what was there before (checkpoints, model caches,
weights handed to a rollout engine).

The temporary directories and files come from `tempfile`, which creates them private (0700,
0600); what is renamed into place gets the modes an ordinary `mkdir` or `open` would have
given it under the process's umask, so a teammate or a serving job can read a checkpoint
wherever they could read the rest of the run directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_if_created_normally(root: Path) -> None:
    """Give `root` and everything under it the modes `mkdir` (0777) and `open` (0666) give
    under the umask; executable bits a writer set on a file are kept (masked too)."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for path in Path(root).rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            os.chmod(path, 0o777 & ~mask)
        else:
            executable = path.stat().st_mode & 0o111
            os.chmod(path, (0o666 | executable) & ~mask)


def write_directory(final: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of `final` with `write(tmp)`, flush it, then rename it to
    `final`. An older `final` is renamed aside first and removed only once the new one is in
    place, so at every moment one of them is on disk under a name that says which."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        as_if_created_normally(tmp)
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
    os.chmod(tmp, 0o666 & ~current_umask())
    os.replace(tmp, path)
