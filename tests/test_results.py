"""The results bundle (omni/results.py, omni/report.py): on hand-made inputs, what each file
holds and that the page needs nothing from elsewhere; then the real CLI on the tiny model."""

import hashlib
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from omni import results
from omni.data.prompts import Prompt
from tests.recipes.test_train import train

CONFIG = {"seed": 3, "trainer": {"steps": 7, "lr": 1e-4}, "model": {"family": "sd3", "lora": {"rank": 4}}}
HISTORY = [
    (0, {"eval/reward": 0.5}),
    (1, {"train/loss": 0.25, "train/lr": 1e-4, "reward/reward": 0.4}),
    (2, {"train/loss": float("nan"), "train/lr": 1e-4, "reward/reward": 0.45}),
    (2, {"eval/reward": 0.6}),
]


def checkpoint(run_dir: Path, step: int = 2) -> Path:
    directory = run_dir / "checkpoints" / f"step_{step:06d}"
    directory.mkdir(parents=True)
    (directory / "pytorch_lora_weights.safetensors").write_bytes(bytes(range(256)) * 3 + bytes([step]))
    (directory / "trainer_state.pt").write_bytes(b"state" * 100)
    return directory


def bundle(run_dir: Path, made_by="checkpoints/step_000002", **changes) -> Path:
    saved = run_dir / made_by
    if not saved.exists():
        checkpoint(run_dir, int(made_by[-6:]))
    prompts = run_dir / "prompts.txt"
    prompts.write_text("a red square\na blue circle\n")
    images = [(Image.new("RGB", (8, 8), colour), f"prompt {i}") for i, colour in enumerate(("red", "blue", "green"))]
    arguments = dict(
        config=CONFIG,
        metrics={"eval/reward": 0.6, "eval/odd": float("inf")},
        per_category={"colors": {"mean": 0.6, "n": 2}},
        history=HISTORY,
        images=images,
        checkpoint_files=sorted(p for p in saved.iterdir()),
        prompt_files={"train": prompts, "eval": prompts},
        overrides=["trainer.steps=7"],
        made_by=made_by,
        before_after={"before": [0.5, 0.5], "after": [0.6, float("nan")], "start_step": 0, "steps": 7},
        command=["recipes/train.py", "trainer.steps=7"],
    )
    return results.write_results(run_dir / "results", **{**arguments, **changes})


def read(directory: Path, name: str):
    return json.loads((directory / name).read_text())


def test_bundle_holds_the_config_hashes_metrics_and_history(tmp_path):
    directory = bundle(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == sorted(results.FILES)
    assert yaml.safe_load((directory / "config.yaml").read_text()) == CONFIG

    manifest = read(directory, "manifest.json")
    saved = tmp_path / "checkpoints" / "step_000002"
    assert manifest["checkpoint"] == {
        f"checkpoints/step_000002/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in saved.iterdir()
    }
    prompt_hash = hashlib.sha256((tmp_path / "prompts.txt").read_bytes()).hexdigest()
    assert manifest["prompts"]["eval"]["sha256"] == manifest["prompts"]["train"]["sha256"] == prompt_hash
    assert manifest["overrides"] == ["trainer.steps=7"] and manifest["made_by"] == "checkpoints/step_000002"
    assert manifest["packages"]["torch"] == torch.__version__ and manifest["packages"]["python"]
    assert {"torch", "diffusers", "peft", "transformers", "hydra-core", "omegaconf", "verl"} <= set(
        manifest["packages"]
    )
    assert manifest["machine"] == {
        "cpu": results.cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    assert manifest["machine"]["cpu"]

    metrics = read(directory, "metrics.json")  # strict JSON: non-finite numbers as null
    assert metrics["final"] == {"eval/reward": 0.6, "eval/odd": None}
    assert metrics["per_category"] == {"colors": {"mean": 0.6, "n": 2}}
    assert metrics["before"] == [0.5, 0.5] and metrics["after"] == [0.6, None] and metrics["steps"] == 7

    history = read(directory, "history.json")
    assert history["eval/reward"] == [[0, 0.5], [2, 0.6]]
    assert history["train/loss"] == [[1, 0.25], [2, None]]
    assert set(history) == {"eval/reward", "train/loss", "train/lr", "reward/reward"}


def test_per_category_means_over_tagged_finite_scores():
    tags = ["counting", "colors", None, "counting", "colors", "counting"]
    scores = [1.0, 0.25, 9.0, 0.0, math.nan, 0.5]
    assert results.per_category(tags, scores) == {
        "colors": {"mean": 0.25, "n": 1},
        "counting": {"mean": 0.5, "n": 3},
    }


def test_report_is_self_contained(tmp_path):
    page = (bundle(tmp_path) / "report.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) == page.count("<img") == 3
    assert all(source.startswith("data:image/png;base64,") for source in sources)
    # a chart per family of keys: eval, reward, train
    assert page.count("<svg") == 3
    assert "prompt 1" in page and "colors" in page


def test_evaluation_record_keeps_each_prompts_first_image_and_its_score():
    prompts = [Prompt("a red cube", {"tag": "colors"}), Prompt("two dogs", {"tag": "counting"}), Prompt("plain")]
    per_prompt = 2
    repeated = [p for p in prompts for _ in range(per_prompt)]
    images = torch.zeros(len(repeated), 3, 4, 4)
    images[2] = 1.0  # the second prompt's first image is white
    scores = torch.tensor([0.1, 0.2, 0.3, 0.4, math.nan, 0.6])
    record = results.record_evaluation(repeated, images, scores, per_prompt)
    assert record.tags == ["colors", "colors", "counting", "counting", None, None]
    assert [caption for _, caption in record.images] == [
        "a red cube (reward 0.1)",
        "two dogs (reward 0.3)",
        "plain (reward not scored)",
    ]
    assert record.images[1][0].getpixel((0, 0)) == (255, 255, 255)
    assert record.images[0][0].getpixel((0, 0)) == (0, 0, 0)


def test_refuses_a_results_directory_it_did_not_make(tmp_path):
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(results.ResultsNotOurs, match="not made by a training run"):
        bundle(tmp_path)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    other = tmp_path / "other"
    bundle(other)  # made by other/checkpoints/step_000002
    before = (other / "results" / "manifest.json").read_text()
    with pytest.raises(results.ResultsNotOurs, match="checkpoints/step_000002"):
        bundle(other, made_by="checkpoints/step_000004")  # a run that does not continue it
    assert (other / "results" / "manifest.json").read_text() == before


def test_a_resumed_run_replaces_its_own_bundle_and_carries_its_history_on(tmp_path):
    bundle(tmp_path)
    later = [(2, {"eval/reward": 0.65}), (3, {"train/loss": 0.125}), (4, {"eval/reward": 0.7})]
    directory = bundle(
        tmp_path, made_by="checkpoints/step_000004", replaces=["checkpoints/step_000002"], history=later, start_step=2
    )
    assert read(directory, "manifest.json")["made_by"] == "checkpoints/step_000004"
    history = read(directory, "history.json")
    assert history["eval/reward"] == [[0, 0.5], [2, 0.65], [4, 0.7]]  # step 2 logged again: the new value
    assert history["train/loss"] == [[1, 0.25], [2, None], [3, 0.125]]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".results")]  # no temporary left


def test_git_state_of_a_checkout_and_of_a_plain_directory(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert results.git_state(plain) == {"commit": None, "dirty": None}
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        env = ["-c", "user.name=test", "-c", "user.email=test@example.com"]
        return subprocess.run(["git", *env, "-C", str(repo), *args], capture_output=True, text=True, check=True)

    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert results.git_state(repo) == {"commit": head, "dirty": False}
    (repo / "a.py").write_text("x = 2\n")
    assert results.git_state(repo) == {"commit": head, "dirty": True}
    inner = repo / "inner"  # a directory inside someone else's checkout is not a checkout
    inner.mkdir()
    assert results.git_state(inner) == {"commit": None, "dirty": None}


@pytest.mark.slow
def test_training_run_leaves_its_results(tmp_path, tiny_cache):
    """The real CLI, 1 step then resumed to 2: the bundle describes the run as it ran, and the
    resumed run replaces it; another run in the directory is refused before any model loads."""
    run_dir = tmp_path / "run"
    train(run_dir, tiny_cache, "trainer.steps=1", "trainer.batch_size=16")
    train(run_dir, tiny_cache, "trainer.steps=2", "trainer.batch_size=16", "trainer.resume=auto")
    directory = run_dir / "results"

    config = yaml.safe_load((directory / "config.yaml").read_text())
    assert config["trainer"]["steps"] == 2 and config["trainer"]["resume"] == "auto"
    manifest = read(directory, "manifest.json")
    assert "trainer.steps=2" in manifest["overrides"] and manifest["made_by"] == "checkpoints/step_000002"
    saved = sorted((run_dir / "checkpoints" / "step_000002").iterdir())
    assert manifest["checkpoint"] == {
        f"checkpoints/step_000002/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in saved
    }
    assert manifest["prompts"]["eval"]["file"].endswith("colors_eval.txt")

    metrics, summary = read(directory, "metrics.json"), read(run_dir, "eval.json")
    assert {key: metrics[key] for key in summary} == summary
    assert metrics["final"]["eval/reward"] == pytest.approx(sum(summary["after"]) / len(summary["after"]))
    history = read(directory, "history.json")
    assert [step for step, _ in history["eval/reward"]] == [0, 1, 2]  # the first run's, then the resumed one's
    assert [step for step, _ in history["train/lr"]] == [1, 2]
    page = (directory / "report.html").read_text()
    eval_prompts = (Path(results.__file__).parent / "assets" / "colors_eval.txt").read_text().splitlines()
    assert page.count("<img") == len([p for p in eval_prompts if p.strip()])

    refused = train(run_dir, tiny_cache, "trainer.steps=1", "trainer.resume=null", check=False)
    assert refused.returncode != 0 and "checkpoints of an earlier run" in refused.stderr + refused.stdout
    (run_dir / "checkpoints").rename(tmp_path / "moved")
    refused = train(run_dir, tiny_cache, "trainer.steps=1", check=False)
    output = refused.stderr + refused.stdout
    assert refused.returncode != 0 and f"{directory} exists" in output and "Loading" not in output
    assert read(directory, "manifest.json") == manifest
