"""The tree as ruff holds it (pyproject.toml's [tool.ruff]): `ruff check` finds nothing and
`ruff format --check` would change nothing. The fix: `ruff format . && ruff check --fix .`."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    pytest.importorskip("ruff", reason="ruff is not installed (it is in the dev extra: pip install -e '.[dev]')")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"
