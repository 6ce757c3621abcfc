"""The `eval` group: its defaults live in the schema, its presets state only what differs, the
keys that moved there from `trainer` are refused naming the new key, and a bad value is
refused naming its key, before any model loads."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from omni.config import EvalConfig
from omni.validation import ConfigError, validate
from tests import cli_process
from tests.conftest import compose_config


def test_the_default_preset_is_the_schema_defaults():
    composed = OmegaConf.to_object(compose_config().eval)
    assert composed == EvalConfig()
    assert (EvalConfig().every, EvalConfig().images_per_prompt, EvalConfig().max_images) == (0, 4, 256)
    assert EvalConfig().sde is False and EvalConfig().log_images == 8 and EvalConfig().rewards == []


def test_the_scenes_preset_samples_the_held_out_scenes_once_each_with_20_ode_steps():
    evaluation = compose_config(["eval=scenes"]).eval
    assert evaluation.prompts == "omni:scenes_eval"
    assert (evaluation.images_per_prompt, evaluation.max_images, evaluation.steps) == (1, None, 20)
    assert evaluation.sde is False and list(evaluation.rewards) == ["scene_geneval"]


def test_null_sampler_fields_take_the_rollouts_values(tiny_cache, tmp_path):
    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", "rollout.num_steps=6"], tmp_path))
    assert (cfg.eval.steps, cfg.eval.resolution, cfg.eval.guidance_scale) == (
        6,
        cfg.rollout.resolution,
        cfg.rollout.guidance_scale,
    )


@pytest.mark.parametrize(
    "old, new",
    [
        ("trainer.eval_every", "eval.every"),
        ("trainer.eval_images_per_prompt", "eval.images_per_prompt"),
        ("trainer.eval_seed", "eval.seed"),
    ],
)
def test_a_moved_key_appended_is_refused_naming_the_new_key(old, new, tmp_path):
    with pytest.raises(ConfigError, match=f"^{old} was moved: use {new}$"):
        validate(compose_config([f"+{old}=2"], tmp_path))


def test_a_moved_key_on_the_command_line_is_refused_naming_the_new_key(tmp_path):
    result = cli_process.run(["recipes/train.py", "trainer.eval_every=5", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert result.returncode != 0
    assert "trainer.eval_every was moved: use eval.every" in result.stderr
    assert not any(tmp_path.iterdir())  # refused before Hydra made the run directory's files


@pytest.mark.parametrize(
    "override, named",
    [
        ("eval.every=-1", "eval.every=-1"),
        ("eval.images_per_prompt=0", "eval.images_per_prompt=0"),
        ("eval.max_images=2", "eval.max_images=2 must be >= eval.images_per_prompt=4"),
        ("eval.steps=1", "eval.steps=1"),
        ("eval.guidance_scale=-1", "eval.guidance_scale=-1"),
        ("eval.resolution=0", "eval.resolution=0"),
        ("eval.resolution=30", "eval.resolution=30: this model takes multiples of"),
        ("eval.negative_prompt=blurry", "eval.negative_prompt='blurry'"),
        ("eval.log_images=-1", "eval.log_images=-1"),
        ("eval.rewards=[nope]", "eval.rewards: 'nope' is no reward"),
        ("eval.rewards=[color,color]", "names a reward twice"),
        ("eval.prompts=/no/such/prompts.txt", "eval.prompts"),
        ("eval.rewards=[scene_geneval]", "eval.rewards.scene_geneval needs"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(override, named, tiny_cache, tmp_path):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("(", r"\(")):
        validate(compose_config([f"model.cache_dir={tiny_cache}", override], tmp_path))


def test_a_sentinel_rollback_needs_checkpoints_at_evaluations(tiny_cache, tmp_path):
    overrides = ["sentinel.enabled=true", "sentinel.stat_shift_sd=3", "sentinel.action=rollback", "eval.every=2"]
    with pytest.raises(ConfigError, match="eval.every=2 and trainer.save_every=3: .* a multiple of eval.every"):
        validate(compose_config([f"model.cache_dir={tiny_cache}", *overrides, "trainer.save_every=3"], tmp_path))
    cfg = validate(compose_config([f"model.cache_dir={tiny_cache}", *overrides, "trainer.save_every=4"], tmp_path))
    assert dataclasses.asdict(cfg.eval)["every"] == 2
