"""scripts/estimate_memory.py (`omni.bench.estimate_memory`) counts the real architecture: on
a checkpoint we can build, its parameter and LoRA counts are those of the loaded model with
the run's adapter."""

import json

import pytest
import torch


def load_script():
    from omni.bench import estimate_memory

    return estimate_memory


def test_counts_match_the_loaded_model(tiny_sd3_dir, capsys):
    from omni.config.model import LoraConfig
    from omni.models.sd3 import FAMILY
    from omni.weights import add_lora_adapter

    script = load_script()
    script.main(["--arch", str(tiny_sd3_dir), "--resolution", "1024", "--micro-batch", "64", "model.lora.rank=4"])
    rows = json.loads(capsys.readouterr().out)
    transformer = FAMILY.load_transformer(tiny_sd3_dir, torch.float32)
    assert rows[0]["params"] == sum(p.numel() for p in transformer.parameters())
    add_lora_adapter(transformer, LoraConfig(rank=4, target_modules=list(FAMILY.lora_targets)))
    assert rows[0]["lora_params"] == sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    plain, checkpointed = (r["gib_per_gpu"]["activations"] for r in rows)
    assert checkpointed < plain


def test_sharing_the_actor_and_offloading_the_encoders_lower_the_peak():
    from omni import memory

    sizes = dict(params=2_000_000_000, block_params=80_000_000, lora_params=10_000_000, hidden=1536, blocks=24, patch=2,
                 text_encoder_params=5_000_000_000, vae_params=80_000_000)  # fmt: skip
    settings = dict(tokens=1357, micro_batch=4, workers=8, fsdp=2, dtype="bfloat16", passes=2, checkpointing=True)
    own_copy = memory.estimate(sizes, **settings, shared=False, offload=False)
    shared = memory.estimate(sizes, **settings, shared=True, offload=False)
    offloaded = memory.estimate(sizes, **settings, shared=True, offload=True)
    assert own_copy["engine_transformer"] > 0 and shared["engine_transformer"] == 0
    # gathered for the rollout: the whole transformer, less the shard the worker already holds
    assert shared["rollout_gathered_transformer"] == round(2_000_000_000 * 2 * 7 / 8 / 2**30, 2)
    assert offloaded["train_phase"] == pytest.approx(shared["train_phase"] - shared["text_encoders"], abs=0.02)
    assert own_copy["total"] > shared["total"] > offloaded["total"]


def test_flux_counts_match_the_loaded_model(tiny_flux_dir, capsys):
    from omni.config.model import LoraConfig
    from omni.models.flux import FAMILY
    from omni.weights import add_lora_adapter

    load_script().main(["--arch", str(tiny_flux_dir), "--resolution", "64", "model=flux_tiny", "model.lora.rank=4"])
    (plain, _) = json.loads(capsys.readouterr().out)
    transformer = FAMILY.load_transformer(tiny_flux_dir, torch.float32)
    assert plain["params"] == sum(p.numel() for p in transformer.parameters())
    add_lora_adapter(transformer, LoraConfig(rank=4, target_modules=list(FAMILY.lora_targets)))
    assert plain["lora_params"] == sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    assert plain["tokens"] == (64 // 16) ** 2 + 16


def test_published_flux_on_eight_gpus(capsys):
    """FLUX.1-dev's real architecture (the "12B" transformer, 19 double and 38 single blocks),
    its distilled guidance in one pass, sharded over 8 workers."""
    load_script().main(["model=flux", "trainer.n_workers=8", "--resolution", "1024", "--gradient-checkpointing"])
    rows = {r["arch"]: r for r in json.loads(capsys.readouterr().out)}
    dev = rows["flux.1-dev"]
    assert set(rows) == {"flux.1-dev", "flux.1-schnell"} and 11.8e9 < dev["params"] < 12.0e9
    assert dev["passes"] == 1 and dev["tokens"] == (1024 // 16) ** 2 + 512 and dev["workers"] == 8
    one_gpu = dev["params"] * 2 / 2**30
    assert dev["gib_per_gpu"]["actor_weights"] < one_gpu / 4


def test_published_qwen_image_on_eight_gpus(capsys):
    """Qwen-Image's real architecture (the 20B transformer, 60 double-stream blocks), true CFG
    in two passes, sharded over 8 workers."""
    load_script().main(["model=qwen_image", "trainer.n_workers=8", "--resolution", "1024", "--gradient-checkpointing"])
    (row,) = json.loads(capsys.readouterr().out)
    assert row["arch"] == "qwen-image" and 20.0e9 < row["params"] < 20.7e9
    assert row["passes"] == 2 and row["tokens"] == (1024 // 16) ** 2 + 256 and row["workers"] == 8
    assert row["gib_per_gpu"]["actor_weights"] < row["params"] * 2 / 2**30 / 4


def test_published_wan_14b_counts_its_frames(capsys):
    """Wan2.1-T2V-14B's real architecture (40 blocks, 5120 wide) at flow_grpo's video size: 33
    frames of 240x416 are 9 latent frames of 15 x 26 patches; CFG doubles the passes. The
    frames come from rollout.num_frames, so 81 frames are 21 latent frames."""
    script = load_script()
    args = [
        "model=wan",
        "--arch",
        "wan2.1-t2v-14b",
        "trainer.n_workers=8",
        "--resolution",
        "240x416",
        "--gradient-checkpointing",
    ]
    script.main([*args, "rollout.num_frames=33", "--gpu-memory", "80"])
    (row,) = json.loads(capsys.readouterr().out)
    assert 14.0e9 < row["params"] < 14.5e9 and row["num_frames"] == 33 and row["tokens"] == 9 * 15 * 26
    assert row["passes"] == 2 and row["gib_per_gpu"]["actor_weights"] < row["params"] * 2 / 2**30 / 4
    assert row["gib_per_gpu"]["total"] < 80
    script.main([*args, "rollout.num_frames=81"])
    (longer,) = json.loads(capsys.readouterr().out)
    assert longer["tokens"] == 21 * 15 * 26 and longer["gib_per_gpu"]["activations"] > row["gib_per_gpu"]["activations"]


def test_a_clip_that_does_not_fit_is_refused_naming_its_frames_and_size(capsys):
    args = [
        "model=wan",
        "--arch",
        "wan2.1-t2v-14b",
        "trainer.n_workers=8",
        "rollout.num_frames=81",
        "--resolution",
        "480x832",
    ]
    with pytest.raises(
        SystemExit, match=r"rollout.num_frames=81 at resolution 480x832 needs about .* more than --gpu-memory 80"
    ):
        load_script().main([*args, "--gpu-memory", "80"])
    with pytest.raises(SystemExit, match="samples square images"):
        load_script().main(["model=sd3", "--resolution", "240x416"])


@pytest.fixture
def wan_14b_dir(tmp_path, tiny_wan_dir):
    """A Wan2.1-T2V-14B checkpoint without weights (validation and the estimate read configs
    only): the tiny checkpoint's configs, its transformer's the published 14B's."""
    import shutil
    from importlib import resources

    path = tmp_path / "wan2.1-t2v-14b"
    shutil.copytree(tiny_wan_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    published = resources.files("omni") / "models" / "configs" / "wan2.1-t2v-14b-transformer.json"
    (path / "transformer" / "config.json").write_text(published.read_text())
    return path


def test_a_run_checks_the_estimate_this_script_prints(wan_14b_dir, capsys):
    """Validation refuses a Wan2.1-14B run on 8 GPUs exactly when its own settings need more
    than trainer.device_memory_gib by the script's estimate; its hint's checkpointed figure is
    the script's too."""
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    run = ["model=wan", f"model.path={wan_14b_dir}", "reward=frame_brightness", "trainer=gpu", "trainer.n_workers=8",
           "trainer.n_gpus_per_node=8", "rollout.num_frames=33", "rollout.resolution=320"]  # fmt: skip
    load_script().main(["--resolution", "320", *run])
    plain, checkpointed = (r["gib_per_gpu"]["total"] for r in json.loads(capsys.readouterr().out))
    validate(compose_config([*run, f"trainer.device_memory_gib={plain}"]))
    budget = round(plain - 0.01, 2)
    with pytest.raises(ConfigError) as info:
        validate(compose_config([*run, f"trainer.device_memory_gib={budget}"]))
    assert f"needs about {plain} GiB per device, more than trainer.device_memory_gib={budget}" in str(info.value)
    assert f"model.gradient_checkpointing=true: about {checkpointed} GiB" in str(info.value)
    validate(compose_config([*run, "model.gradient_checkpointing=true", f"trainer.device_memory_gib={checkpointed}"]))


def test_without_a_budget_a_cuda_run_gets_the_devices_memory_and_a_cpu_run_no_check(wan_14b_dir, monkeypatch):
    """trainer.device_memory_gib=null: the 14B's 81 frames at 480 px (hundreds of GiB) pass
    unchecked on the CPU; on CUDA the device's total is the budget (here a simulated 80 GiB
    device: this machine may have none)."""
    import omni.memory as memory
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    run = ["model=wan", f"model.path={wan_14b_dir}", "reward=frame_brightness", "rollout.num_frames=81"]
    validate(compose_config([*run, "trainer.device=cpu"]))
    monkeypatch.setattr(memory, "device_total_gib", lambda: 80.0)
    with pytest.raises(ConfigError, match=r"more than the CUDA device's 80.0 GiB \(trainer.device_memory_gib=null\)"):
        validate(compose_config([*run, "trainer=gpu"]))


def test_unset_sharding_replicates_a_lora_base_only_where_it_fits(wan_14b_dir, tiny_cache):
    """model.fsdp.version=null: several workers replicate a LoRA run's base when the run's
    replicated estimate fits the budget, else shard it with FSDP2; one worker shards nothing;
    full fine-tuning shards; a version given is kept."""
    from omni.memory import estimate_memory
    from omni.models import get_family
    from omni.validation import validate
    from tests.conftest import compose_config

    run = [
        "model=wan",
        f"model.path={wan_14b_dir}",
        "reward=frame_brightness",
        "trainer=gpu",
        "trainer.n_workers=8",
        "trainer.n_gpus_per_node=8",
        "rollout.num_frames=33",
        "rollout.resolution=320",
        "model.gradient_checkpointing=true",
    ]
    replicated = validate(compose_config([*run, "model.fsdp.version=0", "trainer.device_memory_gib=1000"]))
    need = estimate_memory(replicated, get_family("wan"))["gib_per_gpu"]["total"]
    sharded = estimate_memory(replicated, get_family("wan"), fsdp=2)["gib_per_gpu"]["total"]
    assert sharded < need
    assert validate(compose_config([*run, f"trainer.device_memory_gib={need}"])).model.fsdp.version == 0
    assert (
        validate(compose_config([*run, f"trainer.device_memory_gib={round(need - 0.01, 2)}"])).model.fsdp.version == 2
    )
    assert (
        validate(compose_config([*run, "model.fsdp.version=1", "trainer.device_memory_gib=1000"])).model.fsdp.version
        == 1
    )
    tiny = [f"model.cache_dir={tiny_cache}", "trainer.n_workers=2"]
    assert validate(compose_config(tiny)).model.fsdp.version == 0  # the CPU: no budget to check
    assert validate(compose_config([*tiny, "model.lora=null"])).model.fsdp.version == 2
    assert validate(compose_config([f"model.cache_dir={tiny_cache}"])).model.fsdp.version == 0
