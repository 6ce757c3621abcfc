"""Flow-GRPO on the tiny SD3 with rewards beyond the built-in ones: a reward served by
`python -m omni.rewards.serve` in its own process (reward=http)."""

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omni.distributed import free_port
from tests.recipes.test_train import REPO, train

SHORT_RUN = ("trainer.steps=2", "trainer.batch_size=8", "trainer.eval_images_per_prompt=2")


def short_run(tmp_path, eval_prompts=("a red cube", "a blue ball")):
    """Overrides of a 2-step run evaluated on two held-out prompts (a few seconds of sampling)."""
    (tmp_path / "eval.txt").write_text("\n".join(eval_prompts) + "\n")
    return (*SHORT_RUN, f"data.eval={tmp_path / 'eval.txt'}")


@contextlib.contextmanager
def served_reward(*overrides, log):
    """`python -m omni.rewards.serve` in its own process; yields its URL once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "omni.rewards.serve", "--port", str(port), *overrides]
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1.0).raise_for_status()
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the reward server did not start: {Path(log.name).read_text()[-2000:]}")
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
def test_flow_grpo_with_a_served_reward(tmp_path, tiny_cache):
    with open(tmp_path / "server.log", "w") as log, served_reward("reward=brightness", log=log) as url:
        train(tmp_path / "run", tiny_cache, "reward=http", f"reward.components.http.url={url}", *short_run(tmp_path))
    summary = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert summary["steps"] == 2 and len(summary["after"]) == len(summary["before"]) > 0
    assert all(0 < value < 1 for value in summary["before"] + summary["after"])  # brightness, as served
