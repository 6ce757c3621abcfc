"""Each cross-group rule fails before any model loads, with a message naming the key."""

import pytest

from omni.config.validate import ConfigError, validate
from tests.conftest import compose_config

BAD = [
    (["algorithm.group_size=7"], "algorithm.group_size"),
    (["algorithm.group_size=1", "trainer.batch_size=4"], "algorithm.group_size"),
    (["trainer.n_workers=3"], "trainer.n_workers"),
    (["rollout.resolution=72"], "rollout.resolution"),
    (["rollout.layered_summon=true", "rollout.load_base=false"], "rollout.layered_summon"),
    (["model.fsdp.layer_prefixes=[single_transformer_blocks.]"], "model.fsdp.layer_prefixes"),
    (["model.fsdp.layer_prefixes=[]"], "model.fsdp.layer_prefixes"),
    (["model.fsdp.version=3"], "model.fsdp.version"),
    (["model.dtype=float64"], "model.dtype"),
    (["model.lora.adapter_name="], "model.lora.adapter_name"),
    (["+reward.weights.aesthetics=1.0"], "reward.weights"),
    (["~reward.weights.brightness"], "reward.weights"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.num_steps=1"], "rollout.num_steps"),
    (["algorithm=flow_grpo_fast", "algorithm.sde_window_size=20"], "algorithm.sde_window_size"),
    (["algorithm=flow_grpo_fast", "algorithm.sde_window_range=[7,9]"], "algorithm.sde_window_range"),
    (["logger.backends=[console,mlflow]"], "logger.backends"),
    (["trainer.resume=/nonexistent/ckpt"], "trainer.resume"),
    (["data.train=/nonexistent/prompts.txt"], "data.train"),
    (["data.eval=omni:no_such_set"], "data.eval"),
    (["trainer.n_workers=2", "trainer.n_gpus_per_node=1"], "trainer.n_workers=2"),
    (["trainer.n_workers=2", "trainer.nnodes=4"], "trainer.nnodes=4"),
    (["trainer.n_workers=2", "trainer.device=cuda"], "trainer.n_gpus_per_node"),
    (["trainer.n_gpus_per_node=1", "trainer.device=cpu"], "trainer.device=cpu"),
    (["trainer.ray_address=auto"], "trainer.ray_address"),
    (["trainer.n_workers=2", "model.fsdp.version=0"], "model.fsdp.version=0"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[k for _, k in BAD])
def test_bad_config_names_the_key(overrides, key, tiny_cache):
    cfg = compose_config(overrides + [f"model.cache_dir={tiny_cache}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert key in str(info.value)


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


def test_validation_builds_no_model(tmp_path, monkeypatch):
    import omni.models.sd3 as sd3

    monkeypatch.setattr(sd3, "write_tiny_sd3", lambda *a, **k: pytest.fail("validation built a model"))
    validate(compose_config([f"model.cache_dir={tmp_path}"]))
