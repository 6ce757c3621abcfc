"""The log (console and Hydra's train.log) names the model_algorithm pair preset a run got
and what it set, which no command line shows; a real short run of the CLI on the tiny SD3."""

from tests import cli_process
from tests.recipes.test_sweep import SHORT


def test_log_names_the_pair_preset_and_its_settings(tmp_path, tiny_cache):
    command = [
        "recipes/train.py",
        f"hydra.run.dir={tmp_path}",
        f"model.cache_dir={tiny_cache}",
        "trainer.progress_bar=false",
        "algorithm=grpo_guard",
        *SHORT,
        "trainer.lr=5e-3",
    ]
    result = cli_process.run(command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = (
        "model_algorithm=sd3_tiny_grpo_guard applied for model=sd3_tiny with algorithm=grpo_guard "
        "(omni/conf/model_algorithm/sd3_tiny_grpo_guard.yaml): sets algorithm.clip_range=0.2, "
        "trainer.lr=0.01 (overridden: trainer.lr=0.005)"
    )
    assert line in (tmp_path / "train.log").read_text()


def test_log_says_when_no_pair_preset_applies(tmp_path):
    """model=sd3 has no pair preset with flow_grpo; the run stops at validation (no checkpoint)."""
    result = cli_process.run(["recipes/train.py", f"hydra.run.dir={tmp_path}", "model=sd3"], timeout=300)
    assert result.returncode != 0 and "model.path is not set" in result.stderr
    assert "model_algorithm: no preset for model=sd3 with algorithm=flow_grpo" in (tmp_path / "train.log").read_text()
