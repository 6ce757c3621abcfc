"""Flow-GRPO on the tiny SD3 with the OCR reward served by `python -m omni.rewards.serve` in
its own process (reward=http), on prompts whose target texts are only in their metadata, which
must reach the reward through the rollout and over the wire. (The in-process reward=ocr path
is the same trainer code with another component; its scoring is tested in tests/rewards.)"""

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

SHORT_RUN = ("trainer.steps=1", "trainer.batch_size=8", "eval.images_per_prompt=1")


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
            except httpx.TransportError as error:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the reward server did not start: {Path(log.name).read_text()[-2000:]}"
                    ) from error
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


ITEMS = [
    ("a shop sign", "BAKERY"),
    ("a poster on a wall", "SUMMER FAIR"),
    ("a road sign", "SLOW"),
    ("a mug", "MORNING"),
]


def metadata_only_prompts(path: Path) -> Path:
    """A JSONL prompt set whose target texts are only in the metadata (no quotes in the
    prompt), so the OCR reward can score only if each item's metadata reached it."""
    path.write_text("".join(json.dumps({"prompt": prompt, "text": text}) + "\n" for prompt, text in ITEMS))
    return path


def scores_in_unit_interval(run_dir: Path, steps: int) -> None:
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == steps and len(summary["after"]) == len(summary["before"]) > 0
    assert all(0 <= value <= 1 for value in summary["before"] + summary["after"])


@pytest.mark.slow
def test_flow_grpo_with_a_served_reward(tmp_path, tiny_cache):
    items = metadata_only_prompts(tmp_path / "items.jsonl")
    with open(tmp_path / "server.log", "w") as log, served_reward("reward=ocr", log=log) as url:
        train(
            tmp_path / "run",
            tiny_cache,
            "reward=http",
            f"reward.components.http.url={url}",
            f"data.train={items}",
            f"data.eval={items}",
            *SHORT_RUN,
        )
    scores_in_unit_interval(tmp_path / "run", 1)
