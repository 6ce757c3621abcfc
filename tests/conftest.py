"""Shared fixtures: the real Hydra config composed with the compose API, and one tiny SD3 (and
one tiny FLUX, Qwen-Image and Wan) checkpoint built offline per test session."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

# Set before torch loads. pyproject runs the suite in 2 pytest-xdist workers: each takes one
# core with one torch thread (inherited by the processes a test starts, unless the test sets
# its own), and waiting threads yield their core instead of spinning (with more threads than
# cores, spinning slows torch on the CPU by an order of magnitude).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from omegaconf import OmegaConf

from omni.composing import compose_train
from omni.config import CONF_DIR

CONF_DIR = str(CONF_DIR)
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(items):
    """The modules with `slow` tests first, the rest after, each module's tests together and in
    their order: pyproject's `--dist loadscope` hands a worker whole modules in this order, so
    the long ones start early and the two workers finish together (a long module taken last
    left the other worker idle for minutes)."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)


@contextlib.contextmanager
def one_process_group_at_a_time():
    """Held by the tests that start several processes (two training runs, a Ray cluster and
    its workers): the 2 xdist workers never run two such tests at once, so a 2-core runner
    has one of them and at most one in-process test at a time."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "serial")
    with open(Path(tempfile.gettempdir()) / f"omni-tests-{run}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def compose_config(overrides=(), output_dir="/tmp/omni-test-output"):
    """The training config as `recipes/train.py` composes it, with `overrides`."""
    cfg = compose_train(overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.output_dir = str(output_dir)
    OmegaConf.set_struct(cfg, True)
    return cfg


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A model cache directory shared by the session's tests (the tiny SD3 is built once)."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_sd3_dir(tiny_cache) -> Path:
    from omni.models.sd3 import tiny_sd3_path

    return tiny_sd3_path(tiny_cache, seed=0)


@pytest.fixture(scope="session")
def tiny_flux_dir(tiny_cache) -> Path:
    from omni.models.flux import tiny_flux_path

    return tiny_flux_path(tiny_cache, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tiny_cache) -> Path:
    from omni.models.qwen_image import tiny_qwen_image_path

    return tiny_qwen_image_path(tiny_cache, seed=0)


@pytest.fixture(scope="session")
def tiny_wan_dir(tiny_cache) -> Path:
    from omni.models.wan import tiny_wan_path

    return tiny_wan_path(tiny_cache, seed=0)


@pytest.fixture(scope="session")
def synthetic_pairs(tmp_path_factory) -> Path:
    """A small synthetic preference set (the chosen image is the brighter one)."""
    from omni.data.synthetic_pairs import write_synthetic_pairs

    return write_synthetic_pairs(tmp_path_factory.mktemp("pairs"), n_pairs=48, resolution=64, seed=0)


def training_options(cfg, step: int):
    """The sampling options of a Flow-GRPO training step (its SDE window included)."""
    from omni.context import StepContext

    ctx = StepContext(cfg, None, [], [], None)
    algo = cfg.algorithm
    return ctx.sampling_options(
        ctx.sde_window(step, getattr(algo, "sde_window_size", 0), getattr(algo, "sde_window_range", None))
    )
