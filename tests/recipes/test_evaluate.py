"""The real `recipes/evaluate.py` CLI on the tiny SD3 with eval=scenes: the base model and a
checkpoint of a 1-step training run are evaluated per category into eval.json and a results/
bundle whose metrics repeat the training run's final evaluation exactly; a missing
checkpoint is named before any model loads."""

import hashlib
import json
from pathlib import Path

import pytest

from tests import cli_process
from tests.recipes.test_train import train

CATEGORIES = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def evaluate(run_dir, cache, *overrides):
    command = ["recipes/evaluate.py", f"hydra.run.dir={run_dir}", f"model.cache_dir={cache}",
               "trainer.progress_bar=false", "eval=scenes", "eval.max_images=12", *overrides]  # fmt: skip
    return cli_process.run(command, timeout=600)


def evaluated(run_dir, cache, *overrides) -> dict:
    result = evaluate(run_dir, cache, *overrides)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((Path(run_dir) / "eval.json").read_text())
    assert summary["images"] == 12 and len(summary["per_image"]) == 12
    assert list(summary["categories"]["scene_geneval"]) == CATEGORIES
    table = result.stdout[result.stdout.index("category") :].splitlines()
    assert [line.split()[0] for line in table[1:8]] == [*CATEGORIES, "all"]
    return summary


@pytest.mark.slow
def test_the_base_model_and_a_trained_checkpoint_are_evaluated_per_category(tmp_path, tiny_cache):
    base = evaluated(tmp_path / "base", tiny_cache)
    assert base["checkpoint"] is None
    run = tmp_path / "train"
    train(run, tiny_cache, "trainer.steps=1", "trainer.batch_size=8", "algorithm.group_size=4",
          "eval=scenes", "eval.max_images=12")  # fmt: skip
    checkpoint = run / "checkpoints" / "step_000001"
    trained = evaluated(tmp_path / "trained", tiny_cache, f"checkpoint={checkpoint}")
    assert trained["checkpoint"] == str(checkpoint) and trained["step"] == 1
    # the training run's final evaluation, reproduced exactly from its checkpoint, in a bundle
    # that names the checkpoint's files by their hashes
    final = json.loads((run / "results" / "metrics.json").read_text())["final"]
    again = json.loads((tmp_path / "trained" / "results" / "metrics.json").read_text())["final"]
    held_out = {k: v for k, v in final.items() if k.startswith("eval/")}
    assert "eval/scene_geneval/colors" in held_out
    assert held_out == {k: v for k, v in again.items() if k.startswith("eval/")}
    hashes = json.loads((tmp_path / "trained" / "results" / "manifest.json").read_text())["checkpoint"]
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert sorted(hashes.values()) == sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in files)
    # the run's eval.json holds every score image by image, before and after, for paired tests
    scores = json.loads((run / "eval.json").read_text())["scores"]
    for name in ("scene_geneval/accuracy", "brightness"):
        assert scores[name]["after"] == [i[name] for i in trained["per_image"]]
        assert scores[name]["before"] == [i[name] for i in base["per_image"]]
    # the same prompts and seeds; the trained LoRA changed the images, so their scores
    assert [i["seed"] for i in trained["per_image"]] == [i["seed"] for i in base["per_image"]]
    assert [i["brightness"] for i in trained["per_image"]] != [i["brightness"] for i in base["per_image"]]


def test_a_missing_checkpoint_is_named_before_any_model_loads(tmp_path, tiny_cache):
    missing = tmp_path / "no" / "step_000009"
    result = evaluate(tmp_path / "run", tiny_cache, f"checkpoint={missing}")
    assert result.returncode != 0
    assert f"checkpoint={missing}: no such checkpoint directory" in result.stderr
    assert "Loading pipeline components" not in result.stderr
    assert not (tmp_path / "run" / "eval.json").exists()
