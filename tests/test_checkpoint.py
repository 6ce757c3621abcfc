"""Checkpoints: resume finds the newest intact one, a damaged one is named and never loaded,
what a killed save leaves is cleaned up, and one run directory has one writer."""

import errno
import os
import stat
import subprocess
import sys

import pytest
import torch

from omni import checkpoint
from omni.config.model import LoraConfig, ModelConfig
from omni.models.sd3 import FAMILY
from omni.run_lock import RunDirectoryInUse, RunLock

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["to_q", "to_k"])
MODEL = ModelConfig(family="sd3", lora=LORA)  # the run's `model` config a checkpoint is checked against


def fake_lora(rank=4, targets=("to_q", "to_k")):
    return {
        f"transformer_blocks.0.attn.{t}.lora_{ab}.weight": torch.ones(shape)
        for t in targets
        for ab, shape in (("A", (rank, 16)), ("B", (16, rank)))
    }


def save(root, step, **lora_kwargs):
    state = {"optimizer": {}, "rng": checkpoint.rng_state(), "config": ""}
    return checkpoint.save_checkpoint(root, step, fake_lora(**lora_kwargs), LORA, state, FAMILY)


def test_resume_skips_damaged_and_missing_checkpoints(tmp_path):
    save(tmp_path, 2)
    truncated = save(tmp_path, 4) / checkpoint.LORA_FILE
    truncated.write_bytes(truncated.read_bytes()[:40])
    (save(tmp_path, 5) / checkpoint.STATE_FILE).write_bytes(b"not a pickle")
    (tmp_path / "latest").write_text("step_000009")  # names one that is gone
    found, skipped = checkpoint.resumable_checkpoint(tmp_path, MODEL)
    assert found == tmp_path / "step_000002"
    assert (
        len(skipped) == 2
        and "step_000005/trainer_state.pt" in skipped[0]
        and "step_000004/pytorch_lora_weights" in skipped[1]
    )


def test_a_damaged_checkpoint_is_never_loaded(tmp_path):
    damaged = save(tmp_path, 3) / checkpoint.LORA_FILE
    damaged.write_bytes(b"\x00" * 16)
    with pytest.raises(checkpoint.DamagedCheckpoint, match="pytorch_lora_weights.safetensors: unreadable"):
        checkpoint.load_checkpoint(tmp_path / "step_000003", FAMILY)


@pytest.mark.parametrize(
    "lora_kwargs,message",
    [
        ({"rank": 8}, "saved LoRA rank 8, configured 4 \\(model.lora.rank\\)"),
        ({"targets": ("to_q", "to_v")}, "missing \\['to_k'\\]"),
    ],
)
def test_a_checkpoint_of_another_lora_is_named(tmp_path, lora_kwargs, message):
    directory = save(tmp_path, 1, **lora_kwargs)
    with pytest.raises(checkpoint.CheckpointMismatch, match=message):
        checkpoint.check_checkpoint(directory, MODEL)


@pytest.mark.parametrize(
    "saved,message",
    [
        ({"family": "flux"}, "saved model family flux, configured sd3 \\(model.family\\)"),
        ({"lora": None}, "saved the whole transformer \\(full fine-tuning, model.lora=null\\), configured a LoRA"),
        (
            {"lora": {"rank": 4, "alpha": 4.0, "target_modules": ["to_k", "to_q"]}},
            "saved LoRA alpha 4.0, configured 8.0 \\(model.lora.alpha\\)",
        ),
    ],
)
def test_the_saved_config_names_what_differs_before_any_tensor_is_read(tmp_path, saved, message):
    """The trainer state records the config the checkpoint was saved with; a change of
    family, kind or LoRA setting is a mismatch (not damage), named saved against configured."""
    from omegaconf import OmegaConf

    model = {"family": "sd3", "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k"]}}
    state = {"optimizer": {}, "rng": checkpoint.rng_state(), "config": OmegaConf.to_yaml({"model": {**model, **saved}})}
    directory = checkpoint.save_checkpoint(tmp_path, 1, fake_lora(), LORA, state, FAMILY)
    with pytest.raises(checkpoint.CheckpointMismatch, match=message):
        checkpoint.check_checkpoint(directory, MODEL)
    assert checkpoint.resumable_checkpoint(tmp_path) == (directory, [])  # intact: only another configuration's


def test_interrupted_saves_are_cleaned_and_an_aside_step_restored(tmp_path):
    save(tmp_path, 1)
    (tmp_path / ".step_000002.k3j2").mkdir()  # a save killed while writing
    (tmp_path / "step_000001").rename(tmp_path / ".step_000001.old.x8")  # killed between the renames
    done = checkpoint.clean_interrupted_writes(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert len(done) == 2 and checkpoint.resumable_checkpoint(tmp_path, MODEL)[0] == tmp_path / "step_000001"


HOLD = (
    "import sys, time; from omni.run_lock import RunLock; RunLock(sys.argv[1]).__enter__(); "
    "print('held', flush=True); time.sleep(600)"
)


def test_a_second_writer_of_a_run_directory_is_refused(tmp_path):
    """Held by another process: refused; that process killed: the system released the lock.
    Within one process, holding a directory it holds already does nothing."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryInUse, match=f"{tmp_path} is in use by a running training run"):
            with RunLock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path), RunLock(tmp_path):  # released with the killed holder; re-entered
        pass


def test_a_checkpoint_is_readable_as_the_umask_allows(tmp_path):
    """A teammate or a serving job reads what the umask lets them (0o022: the group and
    others read), not the 0700/0600 of the temporary names the save renames into place."""
    old = os.umask(0o022)
    try:
        directory = save(tmp_path, 1)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (directory, *directory.iterdir(), tmp_path / "latest")}
    assert modes == {"step_000001": 0o755, checkpoint.LORA_FILE: 0o644, checkpoint.STATE_FILE: 0o644, "latest": 0o644}


class DiskFillsUp:
    """The family's LoRA writer, with the disk filling up half-way through the file."""

    def save_lora(self, directory, lora, metadata):
        (directory / checkpoint.LORA_FILE).write_bytes(b"\x00" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_names_the_disk_and_the_checkpoint_and_keeps_the_older_ones(tmp_path):
    save(tmp_path, 2)
    state = {"optimizer": {}, "rng": checkpoint.rng_state(), "config": ""}
    with pytest.raises(checkpoint.CheckpointSaveFailed) as failure:
        checkpoint.save_checkpoint(tmp_path, 4, fake_lora(), LORA, state, DiskFillsUp())
    message = str(failure.value)
    assert f"could not save checkpoint {tmp_path / 'step_000004'}" in message
    assert (
        f"no space left on the disk holding {tmp_path} (the filesystem mounted at " in message
        and "MiB free now" in message
    )
    assert "saved before it are intact (step_000002)" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]  # no partial step_000004
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert checkpoint.resumable_checkpoint(tmp_path, MODEL) == (tmp_path / "step_000002", [])


def test_an_initial_lora_is_read_from_diffusers_or_peft_files_and_checked(tmp_path):
    """model.lora.init_from: a checkpoint directory (diffusers' names) or PEFT's
    adapter_model.safetensors give the same PEFT-named tensors; another rank names the file."""
    from safetensors.torch import save_file

    diffusers_dir = save(tmp_path / "ours", 1)
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    save_file({f"base_model.model.{k}": v for k, v in fake_lora().items()}, str(peft_dir / checkpoint.PEFT_LORA_FILE))
    for path in (diffusers_dir, peft_dir / checkpoint.PEFT_LORA_FILE):
        checkpoint.check_lora_file(path, LORA)
        assert checkpoint.load_lora_file(path).keys() == fake_lora().keys()
    with pytest.raises(
        checkpoint.CheckpointMismatch, match=f"{peft_dir}/adapter_model.safetensors: saved LoRA rank 4, configured 8"
    ):
        checkpoint.check_lora_file(peft_dir, LoraConfig(rank=8, target_modules=["to_q", "to_k"]))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: holds neither pytorch_lora_weights.safetensors"):
        checkpoint.check_lora_file(tmp_path, LORA)
