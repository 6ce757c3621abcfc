"""Each cross-group rule fails before any model loads, with a message naming the key."""

import re

import pytest
import torch

from omni.validation import ConfigError, validate
from tests.conftest import compose_config

BAD = [
    (["algorithm.group_size=7"], "algorithm.group_size"),
    (["algorithm.group_size=1", "trainer.batch_size=4"], "algorithm.group_size"),
    (["trainer.n_workers=3"], "trainer.n_workers"),
    (["rollout.resolution=72"], "rollout.resolution"),
    (["rollout.layered_summon=true", "rollout.load_base=false"], "rollout.layered_summon"),
    (
        ["rollout.share_actor=true", "trainer.n_workers=2", "model.fsdp.version=1"],
        "rollout.share_actor=true with model.fsdp.version=1",
    ),
    (["model.fsdp.layer_prefixes=[single_transformer_blocks.]"], "model.fsdp.layer_prefixes"),
    (["model.fsdp.layer_prefixes=[]"], "model.fsdp.layer_prefixes"),
    (["model.fsdp.version=3"], "model.fsdp.version"),
    (["model.lora.adapter_name="], "model.lora.adapter_name"),
    (["+reward.components.aesthetics={}"], "reward.components=aesthetics"),
    (["~reward.components.brightness"], "reward.components"),
    (["reward.components.brightness.weight=0"], "reward.components"),
    # weights that cancel out, and a NaN or inf weight, found here rather than at the first evaluation
    (
        ["reward=multi", "reward.components.brightness.weight=1", "reward.components.jpeg_compressibility.weight=-1"],
        "reward.components: the weights sum to 0 (reward.components.brightness.weight=1.0 + "
        "reward.components.jpeg_compressibility.weight=-1.0)",
    ),
    (
        ["reward.components.brightness.weight=nan"],
        "reward.components.brightness.weight=nan: a weight must be a finite number",
    ),
    (
        ["reward=multi", "reward.components.jpeg_compressibility.weight=-inf"],
        "reward.components.jpeg_compressibility.weight=-inf",
    ),
    (["+reward.components.color={qualty: 3}"], "reward.components.color"),
    (["rollout.num_steps=1"], "rollout.num_steps"),
    (["algorithm=flow_grpo_fast", "algorithm.sde_window_size=20"], "algorithm.sde_window_size"),
    (["algorithm=flow_grpo_fast", "algorithm.sde_window_range=[7,9]"], "algorithm.sde_window_range"),
    (["trainer.lr=0"], "trainer.lr"),
    (["trainer.batch_size=0"], "trainer.batch_size"),
    (["trainer.max_grad_norm=-1"], "trainer.max_grad_norm"),
    (["eval.images_per_prompt=0"], "eval.images_per_prompt"),
    (["algorithm.num_minibatches=0"], "algorithm.num_minibatches"),
    (["algorithm.num_minibatches=11"], "algorithm.num_minibatches"),
    (["algorithm=flow_grpo_fast", "algorithm.num_minibatches=3"], "algorithm.num_minibatches"),
    (["algorithm.clip_range=0"], "algorithm.clip_range"),
    (["algorithm=online_dpo", "algorithm.beta=0"], "algorithm.beta"),
    (["algorithm.name=ppo"], "algorithm.name=ppo"),
    (["model.family=sd4"], "model.family=sd4"),
    (["rollout.guidance_scale=-1"], "rollout.guidance_scale"),
    (["model.path=/ckpt/sd3"], "model.path"),
    (["model.lora.target_modules=[to_q,to_qq]"], "model.lora.target_modules: ['to_qq']"),
    (["trainer.steps=0"], "trainer.eval_only"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps"),
    (["trainer.warmup_steps=50"], "trainer.warmup_steps=50 must be in [0, trainer.steps=50)"),
    (["trainer.keep_last_checkpoints=0"], "trainer.keep_last_checkpoints=0 must be >= 1"),
    (
        ["model.lora.init_from=/nonexistent/lora"],
        "model.lora.init_from=/nonexistent/lora: /nonexistent/lora: no such LoRA file",
    ),
    (["trainer.resume=/nonexistent/ckpt"], "trainer.resume"),
    (["data.train=/nonexistent/prompts.txt"], "data.train"),
    (["data.eval=omni:no_such_set"], "data.eval"),
    (["trainer.n_workers=2", "trainer.n_gpus_per_node=1"], "trainer.n_workers=2"),
    (["trainer.n_workers=2", "trainer.nnodes=4"], "trainer.nnodes=4"),
    (["trainer.n_workers=2", "trainer.device=cuda"], "trainer.n_gpus_per_node"),
    (["trainer.n_gpus_per_node=1", "trainer.device=cpu"], "trainer.device=cpu"),
    (["trainer.ray_address=auto"], "trainer.ray_address"),
    (["trainer.device_memory_gib=0"], "trainer.device_memory_gib=0.0 must be at least 0.01"),
    (["algorithm=dpo", "data=pairs", "data.pairs=/nonexistent/pairs.jsonl"], "data.pairs=/nonexistent/pairs.jsonl"),
    (["algorithm=dpo", "data=pairs", "data.pairs=/tmp", "data.num_workers=-1"], "data.num_workers=-1"),
    (
        ["algorithm=dpo", "data=pairs", "data.pairs=/tmp", "data.latent_cache=/etc/passwd"],
        "data.latent_cache=/etc/passwd",
    ),
    # full fine-tuning: every sync sends the whole transformer, which the layered walk does not
    (
        ["model.lora=null", "rollout.layered_summon=true", "rollout.share_actor=false"],
        "model.lora=null (full fine-tuning): the layered",
    ),
    (
        ["model.lora=null", "rollout.layered_summon=true", "rollout.share_actor=false"],
        "rollout.layered_summon=true with model.lora=null",
    ),
    (["model.lora=null", "model.dtype=bfloat16"], "model.lora=null (full fine-tuning) with model.dtype=bfloat16"),
    (["model.lora=null", "trainer.ema_decay=0.9"], "trainer.ema_decay=0.9 with model.lora=null"),
    # a shared actor (the default with one in-process worker), LoRA or full fine-tuning: no own copy, no sync
    (["rollout.layered_summon=true"], "rollout.layered_summon=true with a shared actor (rollout.share_actor=null"),
    (
        ["model.lora=null", "rollout.layered_summon=true"],
        "rollout.layered_summon=true with a shared actor (rollout.share_actor=null, shared where possible: "
        "rollout.engine=diffusers, trainer.n_workers=1, model.lora=null (full fine-tuning))",
    ),
    (
        ["model.lora=null", "rollout.share_actor=true", "rollout.layered_summon=true"],
        "rollout.layered_summon=true with a shared actor",
    ),
    (["rollout.load_base=false"], "rollout.load_base=false with a shared actor"),
    # shared initial noise: groups that part by SDE steps, sampled in process
    (
        ["algorithm=diffusion_nft", "rollout.initial_noise=per_group"],
        "rollout.initial_noise=per_group: algorithm=diffusion_nft samples its groups with the ODE",
    ),
    (
        ["algorithm=awm", "algorithm.sampler=ode", "rollout.initial_noise=per_group"],
        "rollout.initial_noise=per_group: algorithm=awm samples its groups with the ODE",
    ),
    (["algorithm=tree_grpo", "rollout.initial_noise=per_group"], "rollout.initial_noise=per_group with algorithm=tree"),
    (["rollout=vllm", "rollout.initial_noise=per_group"], "rollout.initial_noise=per_group: rollout.engine=vllm"),
    (["model.lora=null", "rollout.load_base=false"], "rollout.load_base=false with a shared actor"),
]


# closed sets and types are checked by the schema when Hydra composes
BAD_AT_COMPOSITION = [
    (["model.dtype=float64"], "model.dtype"),
    (["trainer.lr_schedule=step"], "trainer.lr_schedule"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.initial_noise=shared"], "rollout.initial_noise"),
    (["algorithm=mix_grpo_flash", "rollout.ode_solver=rk4"], "rollout.ode_solver"),
    (["logger.backends=[console,neptune]"], "logger.backends"),
    (["algorithm=dpo", "algorithm.sigma_sampling=normal"], "algorithm.sigma_sampling"),
    (["rollout.options.url=http://x"], "options"),
    (["reward.components.brightness.quality=3"], "quality"),
    (
        ["reward=multi", "reward.components.jpeg_compressibility.quality=high"],
        "reward.components.jpeg_compressibility.quality",
    ),
]


@pytest.mark.parametrize("overrides,key", BAD_AT_COMPOSITION, ids=[k for _, k in BAD_AT_COMPOSITION])
def test_bad_value_of_a_closed_set_fails_composition(overrides, key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as info:
        compose_config(overrides)
    assert key in str(info.value.__cause__ or info.value)


@pytest.mark.parametrize("overrides,key", BAD, ids=[k for _, k in BAD])
def test_bad_config_names_the_key(overrides, key, tiny_cache):
    cfg = compose_config(overrides + [f"model.cache_dir={tiny_cache}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert key in str(info.value)


def test_non_utf8_prompt_line_is_named(tmp_path, tiny_cache):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red cat\n\xff\xfe a blue dog\na green tree\n")
    with pytest.raises(ConfigError, match="prompts.txt, line 2: not UTF-8"):
        validate(compose_config([f"data.train={prompts}", f"model.cache_dir={tiny_cache}"]))
    validate(compose_config([f"data.train={prompts}", "data.skip_bad_rows=true", f"model.cache_dir={tiny_cache}"]))


def test_damaged_resume_directory_is_named_before_loading(tmp_path, tiny_cache):
    from omni import checkpoint
    from omni.models.sd3 import FAMILY
    from omni.weights import add_lora_adapter, lora_tensors

    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}"]))
    transformer = FAMILY.load_transformer(FAMILY.tiny_path(tiny_cache, 0), torch.float32)
    add_lora_adapter(transformer, cfg.model.lora)
    lora = {k: v.detach() for k, v in lora_tensors(transformer, "default").items()}
    saved = checkpoint.save_checkpoint(tmp_path, 3, lora, cfg.model.lora, {"rng": checkpoint.rng_state()}, FAMILY)
    validate(compose_config([f"model.cache_dir={tiny_cache}", f"trainer.resume={saved}"]))
    with pytest.raises(ConfigError, match="trainer.resume=.*saved LoRA rank 8, configured 4 \\(model.lora.rank\\)"):
        validate(compose_config([f"model.cache_dir={tiny_cache}", f"trainer.resume={saved}", "model.lora.rank=4"]))
    with pytest.raises(
        ConfigError, match="trainer.resume=.*saved a LoRA, configured full fine-tuning \\(model.lora=null\\)"
    ):
        validate(compose_config([f"model.cache_dir={tiny_cache}", f"trainer.resume={saved}", "model.lora=null"]))
    (saved / checkpoint.STATE_FILE).write_bytes(b"\x80")
    with pytest.raises(ConfigError, match="step_000003/trainer_state.pt: unreadable trainer state"):
        validate(compose_config([f"model.cache_dir={tiny_cache}", f"trainer.resume={saved}"]))


def test_empty_prompt_file_is_named(tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ConfigError, match="data.train.*no prompts"):
        validate(compose_config([f"data.train={empty}"]))


def test_real_model_without_path_says_what_to_pass():
    with pytest.raises(ConfigError, match="model.path"):
        validate(compose_config(["model=sd3", "model.path=null"]))


def test_real_model_with_missing_dir_names_it(tmp_path):
    with pytest.raises(ConfigError, match=f"model.path={tmp_path}"):
        validate(compose_config(["model=sd3", f"model.path={tmp_path}"]))


def test_mandatory_real_model_path_is_reported():
    with pytest.raises(Exception, match="model.path"):
        validate(compose_config(["model=sd3"]))


def test_validated_config_is_typed(tiny_cache):
    from omni.config import TrainConfig
    from omni.config.model import DType
    from omni.rewards.jpeg_compressibility import JpegOptions

    cfg = validate(
        compose_config(
            [f"model.cache_dir={tiny_cache}", "reward=multi", "reward.components.jpeg_compressibility.quality=80"]
        )
    )
    assert isinstance(cfg, TrainConfig) and cfg.model.dtype is DType.auto
    assert isinstance(cfg.reward.components["jpeg_compressibility"], JpegOptions)
    assert cfg.reward.components["jpeg_compressibility"].quality == 80
    with pytest.raises(AttributeError):
        _ = cfg.trainer.no_such_key  # a dataclass, not a dict: a misspelt key is an error
    assert list(cfg.model.lora.target_modules) == ["to_q", "to_k", "to_v", "to_out.0"]  # the family's default


@pytest.mark.parametrize(
    "targets, excluded",
    [(None, []), ("[to_q,add_q_proj]", ["transformer_blocks.1.attn.add_q_proj"])],
)
def test_a_lora_leaves_out_only_the_unused_modules_it_targets(targets, excluded, tiny_cache):
    """SD3's last block drops its text outputs: a LoRA on `add_q_proj` leaves that block's
    out; one that does not target it excludes nothing (PEFT warns of an exclusion that
    matches no target, in every run)."""
    overrides = [f"model.cache_dir={tiny_cache}"] + ([f"model.lora.target_modules={targets}"] if targets else [])
    cfg = validate(compose_config(overrides))
    assert list(cfg.model.lora.exclude_modules) == excluded


def test_full_finetuning_validates_in_float32(tiny_cache):
    """model.lora=null: no LoRA to check, the weights train in float32 (rollout.layered_summon
    with it and a shared actor is refused: tests BAD above)."""
    from omni.config.model import DType

    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", "model.lora=null"]))
    assert cfg.model.lora is None and cfg.model.dtype is DType.float32


def test_validation_builds_no_model(tmp_path, monkeypatch):
    import omni.models.sd3 as sd3

    monkeypatch.setattr(sd3, "write_tiny_sd3", lambda *a, **k: pytest.fail("validation built a model"))
    validate(compose_config([f"model.cache_dir={tmp_path}"]))


# FLUX: a resolution it cannot take (VAE factor 8 x 2x2 packing), prefixes it lacks, a text
# longer than its T5 takes, an engine that does not serve it
FLUX_BAD = [
    (["rollout.resolution=72"], "rollout.resolution=72: this model takes multiples of 16"),
    (["model.fsdp.layer_prefixes=[transformer_blocks.,blocks.]"], "'blocks.' names no block container of flux"),
    (["model.max_sequence_length=600"], "model.max_sequence_length=600: FLUX's T5 takes at most 512"),
    (["rollout=vllm", "rollout.options.backend=local"], "model.family=flux is not yet served by the vLLM-Omni engine"),
]


@pytest.mark.parametrize("overrides,message", FLUX_BAD, ids=[m.split(":")[0] for _, m in FLUX_BAD])
def test_bad_flux_config_says_what_flux_takes(overrides, message, tmp_path, monkeypatch):
    import omni.models.flux as flux

    monkeypatch.setattr(flux, "write_tiny_flux", lambda *a, **k: pytest.fail("validation built a model"))
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=flux_tiny", f"model.cache_dir={tmp_path}", *overrides]))
    assert message in str(info.value)


def test_flux_schnell_takes_no_guidance(tmp_path):
    """A checkpoint without FLUX.1-dev's guidance embedding, read from its config alone."""
    from omni.models.flux import write_tiny_flux

    schnell = write_tiny_flux(tmp_path / "schnell", guidance_embeds=False)
    real = ["model=flux", f"model.path={schnell}", "model.resolution=64", "model.max_sequence_length=16"]
    with pytest.raises(
        ConfigError, match="rollout.guidance_scale=3.5: this FLUX transformer has no guidance embedding"
    ):
        validate(compose_config(real))
    assert validate(compose_config([*real, "model.guidance_scale=0"])).rollout.guidance_scale == 0


def test_flux_without_path_says_what_to_pass():
    with pytest.raises(ConfigError, match="model.path"):
        validate(compose_config(["model=flux"]))


# Qwen-Image: a resolution it cannot take (VAE factor 8 x 2x2 packing), a prompt longer than
# the pipeline takes, an engine that does not serve it, no checkpoint
QWEN_IMAGE_BAD = [
    (["rollout.resolution=72"], "rollout.resolution=72: this model takes multiples of 16"),
    (["model.max_sequence_length=2000"], "model.max_sequence_length=2000: Qwen-Image takes at most 1024"),
    (
        ["rollout=vllm", "rollout.options.backend=local"],
        "model.family=qwen_image is not yet served by the vLLM-Omni engine",
    ),
    (
        ["model.vae_inversion_steps=10"],
        "model.vae_inversion_steps=10: Qwen-Image's images are encoded by its VAE's encoder",
    ),
]


@pytest.mark.parametrize("overrides,message", QWEN_IMAGE_BAD, ids=[m.split(":")[0] for _, m in QWEN_IMAGE_BAD])
def test_bad_qwen_image_config_says_what_it_takes(overrides, message, tmp_path, monkeypatch):
    import omni.models.qwen_image as qwen

    monkeypatch.setattr(qwen, "write_tiny_qwen_image", lambda *a, **k: pytest.fail("validation built a model"))
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=qwen_image_tiny", f"model.cache_dir={tmp_path}", *overrides]))
    assert message in str(info.value)


def test_qwen_image_without_path_says_what_to_pass():
    with pytest.raises(ConfigError, match="model.path"):
        validate(compose_config(["model=qwen_image"]))


# Wan: frames its VAE cannot take, image rewards on clips (and clip rewards on images), frames
# for an image model, a resolution it cannot take, an engine that does not serve it
WAN = ["model=wan_tiny", "reward=frame_brightness"]
WAN_BAD = [
    (
        [*WAN, "rollout.num_frames=6"],
        "rollout.num_frames=6: Wan's VAE takes 4k+1 frames (1, 5, 9, ..., 81); the nearest are 5 and 9",
    ),
    ([*WAN, "rollout.num_frames=0"], "rollout.num_frames=0: Wan's VAE takes 4k+1 frames"),
    (["model=wan_tiny"], "reward.components.brightness scores images but model.family=wan makes videos"),
    (
        ["reward=temporal_consistency"],
        "reward.components.temporal_consistency scores videos but model.family=sd3 makes images",
    ),
    (["rollout.num_frames=5"], "rollout.num_frames=5: model.family=sd3 makes images (1 frame)"),
    (
        [*WAN, "reward.components.frame_average.image=temporal_consistency"],
        "frame_average.image=temporal_consistency scores videos",
    ),
    (
        [
            *WAN,
            "reward.components.frame_average.image=jpeg_compressibility",
            "+reward.components.frame_average.image_options.qualty=3",
        ],
        "reward.components.frame_average.image_options.jpeg_compressibility",
    ),
    ([*WAN, "rollout.resolution=40"], "rollout.resolution=40: this model takes multiples of 16"),
    ([*WAN, "rollout.fps=0"], "rollout.fps=0 must be positive"),
    (
        [*WAN, "rollout=vllm", "rollout.options.backend=local"],
        "model.family=wan is not yet served by the vLLM-Omni engine",
    ),
]


@pytest.mark.parametrize("overrides,message", WAN_BAD, ids=[m.split(":")[0] for _, m in WAN_BAD])
def test_bad_wan_config_says_what_it_takes(overrides, message, tmp_path, monkeypatch):
    import omni.models.wan as wan

    monkeypatch.setattr(wan, "write_tiny_wan", lambda *a, **k: pytest.fail("validation built a model"))
    with pytest.raises(ConfigError) as info:
        validate(compose_config([f"model.cache_dir={tmp_path}", *overrides]))
    assert message in str(info.value)


def test_wan_frames_default_to_the_model_and_fps_to_its_rate(tmp_path):
    cfg = validate(compose_config([*WAN, f"model.cache_dir={tmp_path}"]))
    assert (cfg.rollout.num_frames, cfg.rollout.fps, cfg.model.lora.target_modules) == (
        5,
        16,
        ["to_q", "to_k", "to_v", "to_out.0"],
    )
    assert (
        validate(compose_config([*WAN, f"model.cache_dir={tmp_path}", "rollout.num_frames=9"])).rollout.num_frames == 9
    )
    assert validate(compose_config([f"model.cache_dir={tmp_path}"])).rollout.num_frames == 1


def test_wan_two_expert_checkpoint_is_sent_to_wan22(tmp_path, tiny_wan_dir):
    import json
    import shutil

    moe = tmp_path / "a14b"
    shutil.copytree(tiny_wan_dir, moe, ignore=shutil.ignore_patterns("*.safetensors"))
    index = json.loads((moe / "model_index.json").read_text())
    (moe / "model_index.json").write_text(
        json.dumps({**index, "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875})
    )
    with pytest.raises(ConfigError, match="model.path=.*Mixture-of-Experts.*train it with model=wan22"):
        validate(compose_config(["model=wan", f"model.path={moe}", "reward=frame_brightness"]))
    config = validate(compose_config(["model=wan22", f"model.path={moe}", "reward=frame_brightness"]))
    assert config.model.family == "wan22" and config.model.train_experts == ["high_noise", "low_noise"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.train_experts=[middle]", r"model.train_experts=\['middle'\]: expected .* among"),
        ("model.train_experts=[]", r"model.train_experts=\[\]: expected a non-empty list"),
    ],
)
def test_train_experts_are_range_checked_before_any_model_loads(override, message, monkeypatch):
    from omni.models.wan22 import FAMILY

    monkeypatch.setattr(FAMILY, "load_transformer", None)
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(["model=wan22_tiny", "reward=frame_brightness", override]))


def test_expert_settings_are_refused_for_one_transformer():
    with pytest.raises(ConfigError, match=r"model.train_experts=\['low_noise'\]: model.family=wan has one"):
        validate(compose_config(["model=wan_tiny", "reward=frame_brightness", "model.train_experts=[low_noise]"]))
    with pytest.raises(ConfigError, match="model.guidance_scale_2=3.0: the low-noise expert's guidance needs"):
        validate(compose_config(["model=wan22_tiny", "reward=frame_brightness", "model.guidance_scale_2=3"]))


def test_wan_without_path_says_what_to_pass():
    with pytest.raises(ConfigError, match="model.path"):
        validate(compose_config(["model=wan", "reward=frame_brightness"]))


# Memory: a run whose estimated peak per device (omni/memory.py) exceeds trainer.device_memory_gib
# fails before any model loads, naming the settings that drive it
def test_clip_above_the_device_memory_fails_before_any_model_loads(tmp_path, monkeypatch):
    import omni.models.wan as wan
    from omni.trainer import run

    monkeypatch.setattr(wan, "write_tiny_wan", lambda *a, **k: pytest.fail("a model was built"))
    clip = [*WAN, f"model.cache_dir={tmp_path / 'cache'}", "rollout.num_frames=81", "rollout.resolution=128"]
    with pytest.raises(ConfigError) as info:
        run(compose_config([*clip, "trainer.device_memory_gib=0.01"], tmp_path / "run"))
    message = str(info.value)
    needs = re.search(
        r"the run needs about ([0-9.]+) GiB per device, more than trainer.device_memory_gib=0.01 ", message
    )
    assert needs and float(needs.group(1)) > 0.01
    for key in (
        "rollout.num_frames=81",
        "rollout.resolution=128",
        "trainer.micro_batch_size=8",
        "model.gradient_checkpointing=true",
    ):
        assert key in message
    validate(compose_config([*clip, "trainer.device_memory_gib=1"]))
    validate(compose_config([*clip, "trainer.micro_batch_size=2", "trainer.device_memory_gib=0.01"]))


def test_image_above_the_device_memory_names_no_frames(tiny_cache):
    big = [f"model.cache_dir={tiny_cache}", "rollout.resolution=256"]
    with pytest.raises(
        ConfigError, match=r"trainer.device_memory_gib=0.01 \(rollout.resolution=256, trainer.micro_batch_size=8"
    ) as info:
        validate(compose_config([*big, "trainer.device_memory_gib=0.01"]))
    assert "num_frames" not in str(info.value)
    validate(compose_config([*big, "trainer.device_memory_gib=1"]))
