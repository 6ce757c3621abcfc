"""A sweep (`-m`) is refused before any job starts when one of its jobs cannot run.

Hydra's basic sweeper composes every job before launching any (a type error or an unknown
key fails the whole sweep there), but our validation runs inside each job: a bad value in one
job failed it in the middle of the sweep and failed the sweep. `ValidateSweep`, a Hydra
callback (omni/conf/train.yaml, `hydra.callbacks`), composes and validates every job's config
(omni.validation, no model loaded) when the multirun starts, and refuses the sweep
naming each bad job by its number, its overrides and its error. A sampling sweeper
(hparams_search=optuna) draws its trials as it goes: there the sweep's fixed settings are
validated up front, and each trial in its job.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from omni.config.errors import ConfigError

log = logging.getLogger(__name__)
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def job_problem(config: DictConfig, loader, overrides: Sequence[str], num: int) -> Optional[str]:
    """Why job `num` of a sweep cannot run (its composition or validation error), or None."""
    from omni.validation import validate

    try:
        job = loader.load_sweep_config(master_config=config, sweep_overrides=list(overrides))
        with open_dict(job):
            job.hydra.job.num = job.hydra.job.id = num
            output_dir = str(Path(job.hydra.sweep.dir) / str(job.hydra.sweep.subdir))
            del job["hydra"]
            job.output_dir = output_dir
        validate(job)
    except (ConfigError, HydraException) as error:
        return " ".join(str(error).split())
    return None


def sweep_jobs(config: DictConfig, loader) -> List[Sequence[str]]:
    """Each job's overrides as the basic sweeper expands them; for a sampling sweeper, one
    job of the sweep's fixed settings (its trials are drawn later)."""
    parser = OverridesParser.create(config_loader=loader)
    if config.hydra.sweeper._target_ != BASIC_SWEEPER:
        return [
            [
                o.input_line
                for o in parser.parse_overrides(list(config.hydra.overrides.task))
                if not o.is_sweep_override()
            ]
        ]
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = parser.parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


class ValidateSweep(Callback):
    """Validates every job of a sweep when the multirun starts. Hydra turns an exception of a
    callback into a warning, so a refusal prints its line and exits (status 1, as Hydra's own
    errors), before the sweeper has created anything."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        loader, start = GlobalHydra.instance().config_loader(), time.perf_counter()
        jobs = sweep_jobs(config, loader)
        varying = [o for o in {o for job in jobs for o in job} if not all(o in job for job in jobs)]  # what names a job
        bad = []
        for num, overrides in enumerate(jobs):
            problem = job_problem(config, loader, overrides, num)
            if problem:
                bad.append(
                    f"job #{num} ({' '.join(o for o in overrides if o in varying) or 'the fixed settings'}): {problem}"
                )
        if bad:
            sys.stderr.write(
                f"the sweep is refused before any job starts, {len(bad)} of its {len(jobs)} jobs cannot run: "
                f"{'; '.join(bad)}\n"
            )
            raise SystemExit(1)
        what = (
            f"the sweep's {len(jobs)} jobs"
            if config.hydra.sweeper._target_ == BASIC_SWEEPER
            else "the search's fixed settings"
        )
        log.info(f"validated {what} before starting any job ({time.perf_counter() - start:.1f}s)")
