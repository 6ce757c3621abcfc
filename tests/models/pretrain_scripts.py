"""The pretraining scripts (scripts/pretrain_micro*.py) loaded as modules, for the tests that
pin their first steps (with the `one_thread` fixture of tests/models/conftest.py)."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
