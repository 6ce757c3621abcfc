"""Every experiment preset and hyper-parameter search composes with the real defaults list
and validates (tests/config/test_compose.py covers the group x option product)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from omni.composing import compose_train
from omni.validation import ConfigError, validate
from tests.conftest import CONF_DIR, compose_config


def options(group):
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


PUBLISHED = [name for name in options("experiment") if name.endswith("_flow_grpo")]


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_composes_and_validates(name, tiny_cache, tmp_path):
    from omni.models import get_family

    overrides = [f"experiment={name}", f"model.cache_dir={tiny_cache}"]
    cfg = compose_config(overrides, tmp_path)
    if name in PUBLISHED:  # a published run's preset asks for the user's prompts (see below), or edits
        edits = get_family(cfg.model.family).edit
        overrides.append(f"data.train=omni:{'recolor_train' if edits else 'colors_train'}")
    cfg = compose_config(overrides, tmp_path)
    if cfg.model.tiny_seed is None:
        # a preset for a real model needs a checkpoint: its family's tiny one has the same layout
        cfg = compose_config(
            overrides + [f"model.path={get_family(cfg.model.family).tiny_path(tiny_cache, 0)}"], tmp_path
        )
    resolved = validate(cfg)
    assert resolved.trainer.batch_size % resolved.trainer.n_workers == 0


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_preset_requires_the_users_prompts(name, tmp_path):
    """A published run's preset leaves data.train unset (not the toy colour prompts merged
    before it): validation refuses the run until the user names the prompts, and data=<set>
    on the command line still chooses a shipped set."""
    cfg = compose_config([f"experiment={name}", "model.path=/ckpt/model"], tmp_path)
    assert OmegaConf.is_missing(cfg.data, "train") and cfg.data.eval is None
    with pytest.raises(
        ConfigError, match=r"^data.train is mandatory and not set: pass data.train=/path/to/prompts.txt"
    ):
        validate(cfg)
    assert compose_config([f"experiment={name}", "data=ocr"], tmp_path).data.train == "omni:ocr_train"
    assert compose_config([f"experiment={name}", "data.train=/data/p.txt"], tmp_path).data.train == "/data/p.txt"


def test_paper_preset_has_the_paper_settings(tiny_cache, tmp_path):
    cfg = compose_config(["experiment=sd3_flow_grpo", "model.path=/ckpt/sd3.5-medium"], tmp_path)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.trainer.lr) == (32, 64, 3e-4)
    assert (cfg.algorithm.clip_range, cfg.algorithm.kl_coef, cfg.algorithm.group_size) == (1e-4, 0.04, 24)
    assert (cfg.rollout.num_steps, cfg.rollout.noise_level, cfg.rollout.guidance_scale, cfg.rollout.resolution) == (
        10,
        0.7,
        4.5,
        512,
    )


def test_paper_preset_trains_the_joint_attention_of_sd35_medium_only(tmp_path):
    """On the real SD3.5-Medium architecture (meta device, published config), the preset's
    LoRA covers the joint attention's projections of every block and no attn2 projection."""
    import json
    from importlib import resources

    from peft.tuners.tuners_utils import check_target_module_exists

    from omni.models.sd3 import FAMILY
    from omni.weights import peft_lora_config

    lora = compose_config(["experiment=sd3_flow_grpo", "model.path=/ckpt/sd3.5-medium"], tmp_path).model.lora
    config = json.loads((resources.files("omni") / "models" / "configs" / "sd3.5-medium-transformer.json").read_text())
    names = FAMILY.module_names(config=config)
    peft_config = peft_lora_config(OmegaConf.to_object(lora))
    trained = [n for n in names if n and check_target_module_exists(peft_config, n)]
    assert trained and not [n for n in trained if ".attn2." in n]
    blocks = config["num_layers"]
    # q, k, v, out and the context's q, k, v in every block; the last block has no context output
    assert len(trained) == 7 * blocks + (blocks - 1)


@pytest.mark.parametrize("name", options("hparams_search"))
def test_search_composes_and_validates(name, tiny_cache, tmp_path):
    overrides = [
        f"hparams_search={name}",
        "experiment=tiny_sweep",
        f"model.cache_dir={tiny_cache}",
        f"output_dir={tmp_path}",
    ]
    cfg = compose_train(overrides, return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper.direction == "maximize" and sweeper.params
    for key in sweeper.params:
        assert OmegaConf.select(cfg, key) is not None, f"the search names {key}, which the config lacks"
    with open_dict(cfg):
        del cfg["hydra"]
    validate(cfg)


def test_flux_preset_has_the_published_settings(tmp_path):
    cfg = compose_config(["experiment=flux_flow_grpo", "model.path=/ckpt/FLUX.1-dev"], tmp_path)
    assert cfg.model.family == "flux" and (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.trainer.lr) == (64, 128, 3e-4)
    assert (cfg.algorithm.clip_range, cfg.algorithm.kl_coef, cfg.algorithm.group_size) == (1e-4, 0.0, 24)
    assert (cfg.rollout.num_steps, cfg.rollout.noise_level, cfg.rollout.guidance_scale, cfg.rollout.resolution) == (
        6,
        0.9,
        3.5,
        512,
    )


def test_qwen_image_preset_has_the_published_settings(tmp_path):
    cfg = compose_config(["experiment=qwen_image_flow_grpo", "model.path=/ckpt/Qwen-Image"], tmp_path)
    assert cfg.model.family == "qwen_image" and cfg.trainer.batch_size // cfg.algorithm.group_size == 32
    assert (cfg.algorithm.kl_coef, cfg.algorithm.group_size, cfg.algorithm.sde_window_size) == (0.0, 16, 2)
    assert (cfg.rollout.num_steps, cfg.rollout.noise_level, cfg.rollout.guidance_scale, cfg.rollout.resolution) == (
        10,
        1.2,
        4.0,
        512,
    )
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.trainer.lr, cfg.algorithm.clip_range) == (
        64,
        128,
        3e-4,
        1e-4,
    )
    assert {"img_mlp.net.0.proj", "txt_mlp.net.2"} <= set(cfg.model.lora.target_modules)


def test_wan_preset_has_the_published_settings(tmp_path):
    cfg = compose_config(["experiment=wan_flow_grpo", "model.path=/ckpt/Wan2.1-T2V-1.3B-Diffusers"], tmp_path)
    assert cfg.model.family == "wan" and cfg.trainer.batch_size // cfg.trainer.n_workers == 16
    assert (cfg.rollout.num_steps, cfg.rollout.guidance_scale, cfg.rollout.num_frames, cfg.rollout.noise_level) == (
        20,
        4.5,
        33,
        0.7,
    )
    assert (cfg.algorithm.kl_coef, cfg.algorithm.clip_range, cfg.algorithm.group_size, cfg.algorithm.adv_norm) == (
        0.004,
        1e-3,
        4,
        "group",
    )
    assert (cfg.trainer.lr, cfg.trainer.ema_decay, cfg.model.lora.rank, cfg.model.lora.alpha) == (1e-4, 0.9, 32, 64)
    assert cfg.model.max_sequence_length == 512 and cfg.rollout.resolution == 320
