"""omni-recipes as a user installs it: a wheel built from the sources, installed non-editable
into a fresh virtual environment, runs the `omni-train` console script from a directory
outside the repository, with the config groups it carries (pkg://omni.conf)."""

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(command, **kwargs):
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv (reusing this one's packages, --system-site-packages) with the built wheel
    installed --no-deps; returns its bin directory and an environment without PYTHONPATH,
    so that nothing of the checkout is importable there."""
    root = tmp_path_factory.mktemp("package")
    source = root / "source"  # a copy: building in the checkout would leave build/ and egg-info in it
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "omni", source / "omni", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-w", root / "dist", "-q"])
    wheel = next((root / "dist").glob("omni_recipes-*.whl"))
    run([sys.executable, "-m", "venv", "--system-site-packages", root / "venv"])
    bin_dir = root / "venv" / "bin"
    if sys.prefix != sys.base_prefix:  # this interpreter is itself a venv: its packages too, by path only
        # (the lines of a .pth are plain directories: the .pth files there, an editable
        # install of the checkout among them, are not run)
        inner = run(
            [bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
        (Path(inner) / "outer-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([bin_dir / "python", "-m", "pip", "install", "--no-deps", "--force-reinstall", "-q", wheel])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return bin_dir, env, root


def test_installed_package_is_the_wheel_not_the_checkout(installed):
    bin_dir, env, root = installed
    where = run(
        [bin_dir / "python", "-c", "import omni.conf, omni.cli; print(omni.conf.__file__)"], cwd=root, env=env
    ).stdout
    assert str(root / "venv") in where and str(REPO) not in where, where


def test_console_script_composes_the_shipped_config(installed):
    bin_dir, env, root = installed
    out = run(
        [bin_dir / "omni-train", "--cfg", "job", "algorithm=flow_grpo_fast", "logger=tensorboard"], cwd=root, env=env
    ).stdout
    assert "family: sd3" in out and "sde_window_size: 2" in out and "- tensorboard" in out, out


def test_console_script_trains_a_step(installed, tiny_cache):
    bin_dir, env, root = installed
    run_dir = root / "run"
    run(
        [
            bin_dir / "omni-train",
            "trainer.steps=1",
            "trainer.progress_bar=false",
            f"model.cache_dir={tiny_cache}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=root,
        env=env,
    )
    assert "eval reward (held-out prompts and seeds): before" in (run_dir / "train.log").read_text()
    assert (run_dir / "checkpoints" / "step_000001" / "pytorch_lora_weights.safetensors").is_file()
