"""A config error through the real CLI: one clear line naming the key (no traceback unless
HYDRA_FULL_ERROR=1), printed before any model loads; mandatory values and hub ids say what to pass."""

import os

import pytest

from omni.distributed import free_port
from tests import cli_process


def train(*overrides, full_error=False, tmp_path=None):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    run_dir = [f"hydra.run.dir={tmp_path}"] if tmp_path else []
    return cli_process.run(["recipes/train.py", *run_dir, *overrides], env=env, timeout=300)


HYDRA_FRAME = ("Error executing job with overrides:", "Set the environment variable HYDRA_FULL_ERROR=1")


def error_lines(result):
    """stderr's lines but Hydra's frame around the error (which job; how to get the trace)
    and Python warnings (a dependency's import may print some)."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(HYDRA_FRAME)]
    return [line for line in lines if "Warning" not in line and not line.startswith("  ")]


CASES = [
    (
        ["experiment=sd3_flow_grpo", "model.path=/ckpt/sd3.5-medium"],
        "data.train is mandatory and not set: pass data.train=/path/to/prompts.txt",
    ),
    (["+reward.weights.aesthetic=1.0"], "reward.weights: no such key"),
    (
        ["model=sd3", "model.path=stabilityai/stable-diffusion-3.5-medium"],
        "model.path=stabilityai/stable-diffusion-3.5-medium: no such local directory; "
        "it looks like a Hugging Face hub id, but models load from local directories: "
        "download it once (huggingface-cli download stabilityai/stable-diffusion-3.5-medium "
        "--local-dir /ckpt/stable-diffusion-3.5-medium)",
    ),
    (["rollout=vllm", f"rollout.options.url=http://127.0.0.1:{free_port()}"], "rollout.options.url=http://127.0.0.1:"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=["mandatory", "appended-key", "hub-id", "engine-url"])
def test_config_error_is_one_clear_line(overrides, message, tmp_path):
    result = train(*overrides, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_full_error_keeps_the_traceback(tmp_path):
    result = train("+reward.weights.aesthetic=1.0", full_error=True, tmp_path=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr and "reward.weights: no such key" in result.stderr
