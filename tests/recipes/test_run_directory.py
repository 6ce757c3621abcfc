"""The run directory through the real CLI on the tiny model: resume never writes over
checkpoints of another configuration or of an earlier run, and refuses before any model
loads, naming the difference."""

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omni import checkpoint
from tests.recipes.test_train import REPO, train

SMALL = ["trainer.batch_size=8", "algorithm.group_size=4", "rollout.num_steps=4", "trainer.eval_images_per_prompt=1"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_cache):
    """A LoRA run (rank 8) that saved step_000001 and step_000002."""
    run_dir = tmp_path_factory.mktemp("rank8")
    train(run_dir, tiny_cache, *SMALL, "trainer.steps=2", "trainer.save_every=1")
    return run_dir


def digest(run_dir: Path) -> dict:
    """Every file under checkpoints/ and its content's hash."""
    root = Path(run_dir) / "checkpoints"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def start(run_dir, cache, *overrides, flags=()):
    command = [sys.executable, "recipes/train.py", *flags, f"hydra.run.dir={run_dir}", f"model.cache_dir={cache}", "trainer.progress_bar=false",
               *SMALL, *overrides]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def damage_every_state(run_dir: Path) -> None:
    for state in (Path(run_dir) / "checkpoints").glob(f"step_*/{checkpoint.STATE_FILE}"):
        state.write_bytes(b"\x80")


REFUSED = {
    "LoRA rank": (["trainer.resume=auto", "model.lora.rank=16"], "step_000002 was saved by another configuration: saved LoRA rank 8, configured 16 (model.lora.rank)"),
    "full fine-tuning": (["trainer.resume=auto", "model.lora=null"], "saved a LoRA, configured full fine-tuning (model.lora=null)"),
    "model family": (["trainer.resume=auto", "model=flux_tiny"], "saved model family sd3, configured flux (model.family)"),
    "fresh run": ([], "holds checkpoints of an earlier run (step_000001, step_000002) that this run would write over: it starts at step 0"),
    "explicit older step": (["trainer.resume={run_dir}/checkpoints/step_000001"], "of an earlier run (step_000002) that this run would write over"),
    "none usable": (["trainer.resume=auto"], "trainer.resume=auto found checkpoints in {run_dir}/checkpoints but none it can use: {run_dir}/checkpoints/step_000002/trainer_state.pt"),
}


def test_resume_refuses_checkpoints_it_did_not_make_before_any_model_loads(two_checkpoints, tmp_path, tiny_cache):
    """Each case on its own copy of the run directory, all started at once: refused with the
    difference named, no model loaded, and not a byte of the checkpoints changed."""
    saved = digest(two_checkpoints)
    running = {}
    for case, (overrides, _) in REFUSED.items():
        run_dir = tmp_path / case.replace(" ", "_")
        shutil.copytree(two_checkpoints / "checkpoints", run_dir / "checkpoints")
        if case == "none usable":
            damage_every_state(run_dir)
        running[case] = (run_dir, digest(run_dir), start(run_dir, tiny_cache, "trainer.steps=4", *(o.format(run_dir=run_dir) for o in overrides)))
    for case, (run_dir, before, process) in running.items():
        output, _ = process.communicate(timeout=300)
        expected = REFUSED[case][1].format(run_dir=run_dir)
        assert process.returncode != 0 and expected in output, f"{case}: {output[-2000:]}"
        assert "Loading pipeline components" not in output, case
        assert digest(run_dir) == before, case
    assert digest(two_checkpoints) == saved


def test_a_run_directory_in_use_is_refused_before_hydra_writes_into_it(tmp_path, tiny_cache):
    """This test holds the directory as a running training run would; a second run, and a
    multirun whose sweep directory it is, are refused without touching the first run's
    `.hydra/` or log, and write nothing there."""
    from omni.run_lock import RunLock

    (tmp_path / ".hydra").mkdir()
    first = {".hydra/overrides.yaml": "- seed=1\n", "train.log": "the first run's log\n"}
    for name, text in first.items():
        (tmp_path / name).write_text(text)
    with RunLock(tmp_path):
        runs = [start(tmp_path, tiny_cache, "seed=2"), start(tmp_path, tiny_cache, f"hydra.sweep.dir={tmp_path}", "seed=3,4", flags=["-m"])]
        outputs = [process.communicate(timeout=300)[0] for process in runs]
    for process, output in zip(runs, outputs):
        assert process.returncode != 0 and f"{tmp_path} is in use by a running training run" in output, output[-2000:]
    assert {name: (tmp_path / name).read_text() for name in first} == first
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [".hydra", ".hydra/overrides.yaml", ".lock", "train.log"]


def test_the_run_directory_holds_the_resolved_validated_config(two_checkpoints):
    """As YAML: what validation filled in (the family's LoRA targets), interpolations resolved,
    loadable into the schema; the same text as the checkpoints' trainer state holds."""
    import torch
    from omegaconf import OmegaConf

    from omni.config import FlowGRPOConfig, TrainConfig
    from omni.models.sd3 import FAMILY

    text = (two_checkpoints / "resolved_config.yaml").read_text()
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig(algorithm=FlowGRPOConfig())), OmegaConf.create(text)))
    assert "${" not in text and config.output_dir == str(two_checkpoints)
    assert config.model.lora.target_modules == list(FAMILY.lora_targets) and config.model.lora.rank == 8
    assert (config.trainer.steps, config.trainer.save_every, config.rollout.resolution) == (2, 1, 64)
    state = torch.load(two_checkpoints / "checkpoints" / "step_000002" / checkpoint.STATE_FILE, weights_only=False)
    assert state["config"] == text
