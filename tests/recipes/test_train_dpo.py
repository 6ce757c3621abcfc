"""The real CLI with DPO on the tiny model: online DPO raises the held-out reward, resume
is exact, and a bad preference row stops the run before any model loads."""

import json

import pytest
import torch

from tests.recipes.test_train import final_lora, paired_gain, train, train_in_parallel


@pytest.mark.slow
def test_online_dpo_raises_held_out_reward(tmp_path, tiny_cache):
    """Seeds 0 and 1, 25 steps: the held-out reward rises (paired t > 3) by clearly more than
    the +1e-4 the paper's beta gave on the tiny model."""
    runs = {tmp_path / f"seed{seed}": (1, ["algorithm=online_dpo", "trainer.steps=25", f"seed={seed}"]) for seed in (0, 1)}
    train_in_parallel(runs, tiny_cache)
    for run_dir in runs:
        gain, t_stat = paired_gain(run_dir)
        assert gain > 1e-3 and t_stat > 3, f"{run_dir.name}: mean gain {gain:.6f}, t={t_stat:.2f}"


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
