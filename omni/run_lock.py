"""One run directory, one writer: a lock held for the whole run on `<run dir>/.lock`.

The lock is `filelock`'s (an OS lock on an open file, `flock` on POSIX and `msvcrt` on
Windows), so the system releases it when the process ends however it ends (a kill
included): a stale lock file never blocks a later run.

Through the CLI the lock is taken by `RunLockCallback` (registered in `omni/conf/train.yaml`'s
`hydra.callbacks`) when Hydra starts the run, before Hydra creates or writes anything in the
run directory (`.hydra/`, `train.log`): a second run on a directory in use is refused without
touching the first run's files. A multirun takes it on its sweep directory, before
`multirun.yaml`. `omni.trainer.run` takes it too (for runs started from Python), a no-op
where this process already holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback

_HELD: Dict[Path, "RunLock"] = {}  # the run directories this process holds, to their lock


class RunDirectoryInUse(RuntimeError):
    """Another process is writing to this run directory."""


class RunLock:
    """`with RunLock(run_dir):` holds `run_dir` for this process (refused, RunDirectoryInUse,
    while another process holds it); re-entering a directory this process holds does nothing."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / ".lock"
        self.lock: Optional[FileLock] = None

    def __enter__(self) -> "RunLock":
        if self.run_dir in _HELD:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise RunDirectoryInUse(
                f"{self.run_dir} is in use by a running training run (it holds {self.path}); wait for it, "
                f"or give this run its own directory (hydra.run.dir=..., or hydra.sweep.dir=... for a multirun)"
            ) from None
        self.lock, _HELD[self.run_dir] = lock, self
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            del _HELD[self.run_dir]
            self.lock.release()
            self.lock = None


class RunLockCallback(Callback):
    """Hydra callback: hold the run (or sweep) directory from the start of the run, before
    Hydra writes into it, to its end. A directory in use ends the process (SystemExit with
    the one-line reason, exit status 1): Hydra 1.3 reports a callback's exception as a
    warning and carries on."""

    def __init__(self) -> None:
        self.held: Optional[RunLock] = None

    def _hold(self, config: Any, key: str) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        HydraConfig.instance().set_config(config)  # what Hydra does before it resolves the directory
        try:
            self.held = RunLock(Path(str(OmegaConf.select(config, key)))).__enter__()
        except RunDirectoryInUse as error:
            # Hydra turns a callback's exceptions into warnings and runs on: stop the process
            raise SystemExit(f"{type(error).__name__}: {error}") from None

    def _release(self) -> None:
        if self.held is not None:
            self.held.__exit__(None, None, None)
            self.held = None

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._hold(config, "hydra.run.dir")

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        self._release()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._hold(config, "hydra.sweep.dir")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._release()
