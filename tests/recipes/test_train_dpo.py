"""The real CLI with DPO on the tiny model: online DPO raises the held-out reward, resume
is exact, and a bad preference row stops the run before any model loads."""

import json

import pytest
import torch

from tests.recipes.test_train import final_lora, train


@pytest.mark.slow
def test_online_dpo_raises_held_out_reward(tmp_path, tiny_cache):
    train(tmp_path / "run", tiny_cache, "algorithm=online_dpo", "trainer.steps=25")
    summary = json.loads((tmp_path / "run" / "eval.json").read_text())
    gain = torch.tensor(summary["after"]) - torch.tensor(summary["before"])
    t_stat = gain.mean() / (gain.std() / len(gain) ** 0.5)
    assert gain.mean() > 0 and t_stat > 3, f"mean gain {gain.mean():.6f}, t={t_stat:.2f}"


@pytest.mark.slow
def test_offline_dpo_resume_is_exact(tmp_path, tiny_cache, synthetic_pairs):
    common = ["algorithm=dpo", "data=pairs", f"data.pairs={synthetic_pairs}", "trainer.batch_size=8"]
    train(tmp_path / "straight", tiny_cache, *common, "trainer.steps=4")
    train(tmp_path / "resumed", tiny_cache, *common, "trainer.steps=2")
    out = train(tmp_path / "resumed", tiny_cache, *common, "trainer.steps=4", "trainer.resume=auto")
    assert "eval/implicit_accuracy" in out.stdout
    straight, resumed = final_lora(tmp_path / "straight", 4), final_lora(tmp_path / "resumed", 4)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.slow
def test_bad_row_is_named_before_loading(tmp_path, tiny_cache, synthetic_pairs):
    rows = synthetic_pairs.read_text().splitlines()
    bad = json.loads(rows[2])
    bad["chosen"] = "images/missing.png"
    rows[2] = json.dumps(bad)
    broken = synthetic_pairs.parent / "broken.jsonl"
    broken.write_text("\n".join(rows) + "\n")
    common = ["algorithm=dpo", "data=pairs", f"data.pairs={broken}"]
    result = train(tmp_path / "bad", tiny_cache, *common, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "broken.jsonl, line 3" in output
    assert "Loading pipeline components" not in output
    skipped = train(tmp_path / "skip", tiny_cache, *common, "data.skip_bad_rows=true", "trainer.steps=1", "logger.console_every=1")
    assert "data/skipped_bad=1" in skipped.stdout
