"""One run directory, one writer: a lock held for the whole run on `<run dir>/.lock`.

The lock is an advisory `flock` on an open file, so the kernel releases it when the process
ends however it ends (a kill included): a stale lock file never blocks a later run.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class RunDirectoryInUse(RuntimeError):
    """Another process is writing to this run directory."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.file = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise RunDirectoryInUse(
                f"{self.path.parent} is in use by a running training run (pid {holder}); wait for it, "
                f"or give this run its own directory (hydra.run.dir=...)"
            ) from None
        self.file.truncate(0)
        self.file.write(str(os.getpid()))
        self.file.flush()
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
