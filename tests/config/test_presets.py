"""Every experiment preset and hyper-parameter search composes with the real defaults list
and validates (tests/config/test_compose.py covers the group x option product)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from omni.config import register_configs
from omni.config.validate import validate
from tests.conftest import CONF_DIR, compose_config


def options(group):
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_composes_and_validates(name, tiny_cache, tmp_path):
    from omni.models import get_family

    overrides = [f"experiment={name}", f"model.cache_dir={tiny_cache}"]
    cfg = compose_config(overrides, tmp_path)
    if cfg.model.tiny_seed is None:
        # a preset for a real model needs a checkpoint: its family's tiny one has the same layout
        cfg = compose_config(overrides + [f"model.path={get_family(cfg.model.family).tiny_path(tiny_cache, 0)}"], tmp_path)
    resolved = validate(cfg)
    assert resolved.trainer.batch_size % resolved.trainer.n_workers == 0


def test_paper_preset_has_the_paper_settings(tiny_cache, tmp_path):
    cfg = compose_config(["experiment=sd3_flow_grpo", "model.path=/ckpt/sd3.5-medium"], tmp_path)
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.trainer.lr) == (32, 64, 3e-4)
    assert (cfg.algorithm.clip_range, cfg.algorithm.kl_coef, cfg.algorithm.group_size) == (1e-4, 0.04, 24)
    assert (cfg.rollout.num_steps, cfg.rollout.noise_level, cfg.rollout.guidance_scale, cfg.rollout.resolution) == (10, 0.7, 4.5, 512)


@pytest.mark.parametrize("name", options("hparams_search"))
def test_search_composes_and_validates(name, tiny_cache, tmp_path):
    register_configs()
    overrides = [f"hparams_search={name}", "experiment=tiny_sweep", f"model.cache_dir={tiny_cache}", f"output_dir={tmp_path}"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper.direction == "maximize" and sweeper.params
    for key in sweeper.params:
        assert OmegaConf.select(cfg, key) is not None, f"the search names {key}, which the config lacks"
    with open_dict(cfg):
        del cfg["hydra"]
    validate(cfg)
