"""The run directory through the real CLI on the tiny model: resume never writes over
checkpoints of another configuration or of an earlier run, and refuses before any model
loads, naming the difference."""

import hashlib
import shutil
from pathlib import Path

import pytest

from omni import checkpoint
from tests import cli_process
from tests.recipes.test_train import train

SMALL = ["trainer.batch_size=8", "algorithm.group_size=4", "rollout.num_steps=4", "eval.images_per_prompt=1"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_cache):
    """A LoRA run (rank 8) that saved step_000001 and step_000002."""
    run_dir = tmp_path_factory.mktemp("rank8")
    train(run_dir, tiny_cache, *SMALL, "trainer.steps=2", "trainer.save_every=1")
    return run_dir


def digest(run_dir: Path) -> dict:
    """Every file under checkpoints/ and its content's hash."""
    root = Path(run_dir) / "checkpoints"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def start(run_dir, cache, *overrides, flags=()):
    command = [
        "recipes/train.py",
        *flags,
        f"hydra.run.dir={run_dir}",
        f"model.cache_dir={cache}",
        "trainer.progress_bar=false",
        *SMALL,
        *overrides,
    ]
    return cli_process.Run(command, merge_stderr=True)


def damage_every_state(run_dir: Path) -> None:
    for state in (Path(run_dir) / "checkpoints").glob(f"step_*/{checkpoint.STATE_FILE}"):
        state.write_bytes(b"\x80")


REFUSED = {
    "LoRA rank": (
        ["trainer.resume=auto", "model.lora.rank=16"],
        "step_000002 was saved by another configuration: saved LoRA rank 8, configured 16 (model.lora.rank)",
    ),
    "full fine-tuning": (
        ["trainer.resume=auto", "model.lora=null"],
        "saved a LoRA, configured full fine-tuning (model.lora=null)",
    ),
    "model family": (
        ["trainer.resume=auto", "model=flux_tiny"],
        "saved model family sd3, configured flux (model.family)",
    ),
    "fresh run": (
        [],
        "holds checkpoints of an earlier run (step_000001, step_000002) that this run would write over: it starts "
        "at step 0",
    ),
    "explicit older step": (
        ["trainer.resume={run_dir}/checkpoints/step_000001"],
        "of an earlier run (step_000002) that this run would write over",
    ),
    "none usable": (
        ["trainer.resume=auto"],
        "trainer.resume=auto found checkpoints in {run_dir}/checkpoints but none it can use: "
        "{run_dir}/checkpoints/step_000002/trainer_state.pt",
    ),
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
        running[case] = (
            run_dir,
            digest(run_dir),
            start(run_dir, tiny_cache, "trainer.steps=4", *(o.format(run_dir=run_dir) for o in overrides)),
        )
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
        runs = [
            start(tmp_path, tiny_cache, "seed=2"),
            start(tmp_path, tiny_cache, f"hydra.sweep.dir={tmp_path}", "seed=3,4", flags=["-m"]),
        ]
        outputs = [process.communicate(timeout=300)[0] for process in runs]
    for process, output in zip(runs, outputs):
        assert process.returncode != 0 and f"{tmp_path} is in use by a running training run" in output, output[-2000:]
    assert {name: (tmp_path / name).read_text() for name in first} == first
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        ".hydra",
        ".hydra/overrides.yaml",
        ".lock",
        "train.log",
    ]


def test_the_run_directory_holds_the_resolved_validated_config(two_checkpoints):
    """As YAML: what validation filled in (the family's LoRA targets), interpolations resolved,
    loadable into the schema; the same text as the checkpoints' trainer state holds."""
    import torch
    from omegaconf import OmegaConf

    from omni.algorithms.flow_grpo import FlowGRPOConfig
    from omni.config import TrainConfig
    from omni.models.sd3 import FAMILY

    text = (two_checkpoints / "resolved_config.yaml").read_text()
    config = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(TrainConfig(algorithm=FlowGRPOConfig())), OmegaConf.create(text))
    )
    assert "${" not in text and config.output_dir == str(two_checkpoints)
    assert config.model.lora.target_modules == list(FAMILY.lora_targets) and config.model.lora.rank == 8
    assert (config.trainer.steps, config.trainer.save_every, config.rollout.resolution) == (2, 1, 64)
    state = torch.load(two_checkpoints / "checkpoints" / "step_000002" / checkpoint.STATE_FILE, weights_only=False)
    assert state["config"] == text


def steps_in(run_dir: Path) -> list:
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))


@pytest.mark.slow
def test_keep_last_checkpoints_deletes_only_this_runs_older_ones(tmp_path, tiny_cache):
    """A run keeps its newest N; a run resumed from another directory never deletes that
    run's checkpoints; a run continued in its own directory prunes the older process's too."""
    first, second = tmp_path / "first", tmp_path / "second"
    train(first, tiny_cache, *SMALL, "trainer.steps=3", "trainer.save_every=1", "trainer.keep_last_checkpoints=2")
    assert steps_in(first) == ["step_000002", "step_000003"]
    kept = digest(first)
    train(second, tiny_cache, *SMALL, "trainer.steps=4", "trainer.save_every=1", "trainer.keep_last_checkpoints=1",
          f"trainer.resume={first}/checkpoints/step_000002")  # fmt: skip
    assert steps_in(second) == ["step_000004"] and digest(first) == kept
    train(first, tiny_cache, *SMALL, "trainer.steps=4", "trainer.keep_last_checkpoints=1", "trainer.resume=auto")
    assert steps_in(first) == ["step_000004"] and (first / "checkpoints" / "latest").read_text() == "step_000004"


def mean_after(run_dir: Path) -> float:
    import json

    after = json.loads((Path(run_dir) / "eval.json").read_text())
    return sum(after["after"]) / len(after["after"]), sum(after["before"]) / len(after["before"])


@pytest.mark.slow
def test_training_starts_from_an_existing_lora(two_checkpoints, tmp_path, tiny_cache):
    """model.lora.init_from=<a checkpoint directory>: an evaluation of the initial policy
    scores what that run's final evaluation scored (same held-out prompts and seeds), not
    the base model's; a LoRA of another rank, or a missing file, is refused before any model
    loads, naming the file."""
    saved = two_checkpoints / "checkpoints" / "step_000002"
    runs = {
        "from the LoRA": start(
            tmp_path / "a", tiny_cache, f"model.lora.init_from={saved}", "trainer.eval_only=true", "trainer.steps=0"
        ),
        "rank 16": start(tmp_path / "b", tiny_cache, f"model.lora.init_from={saved}", "model.lora.rank=16"),
        "missing": start(tmp_path / "c", tiny_cache, f"model.lora.init_from={tmp_path}/none.safetensors"),
    }
    outputs = {case: process.communicate(timeout=300)[0] for case, process in runs.items()}
    after, before = mean_after(two_checkpoints)
    assert f"held-out reward {after:.4f} at step 0" in outputs["from the LoRA"] and f"{after:.4f}" != f"{before:.4f}", (
        outputs["from the LoRA"][-2000:]
    )
    refused = {
        "rank 16": f"model.lora.init_from={saved}: {saved}/pytorch_lora_weights.safetensors: saved LoRA rank 8, "
        "configured 16 (model.lora.rank)",
        "missing": f"model.lora.init_from={tmp_path}/none.safetensors: {tmp_path}/none.safetensors: no such LoRA "
        "file or directory",
    }
    for case, message in refused.items():
        assert runs[case].returncode != 0 and message in outputs[case], f"{case}: {outputs[case][-2000:]}"
        assert "Loading pipeline components" not in outputs[case], case
