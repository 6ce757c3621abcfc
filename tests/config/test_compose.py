"""Each shipped option of each config group composes, validates and prints; so do the pairs
of options that interact (model x algorithm presets, DPO x data). Model-agnostic: a real
model's option is pointed at its family's tiny checkpoint, which has the same layout."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from omni.loggers import missing_backends
from omni.models import get_family
from omni.rollout.vllm_engine import engine_unavailable
from omni.rollout.vllm_options import VllmOptions
from omni.validation import ConfigError, validate
from tests import cli_process
from tests.conftest import CONF_DIR, compose_config

GROUPS = ("model", "rollout", "algorithm", "reward", "data", "trainer", "logger")
LOCAL_MODEL_REWARDS = ("pickscore", "clipscore", "aesthetic", "hpsv2")  # tested on tiny CLIPs in tests/rewards
# What a reward option needs from its user: prompts with its metadata, a server (contacted only at set-up).
REWARD_NEEDS = {
    "ocr": ["data=ocr"],
    "http": ["reward.components.http.url=http://127.0.0.1:8000"],
    "geneval": ["data=geneval", "reward.components.http.url=http://127.0.0.1:8000"],
    "scene_geneval": ["data=scenes"],
    "vlm_judge": [
        "reward.components.vlm_judge.url=http://127.0.0.1:8000/v1",
        "reward.components.vlm_judge.model=judge",
    ],
}
# An edit model needs edits (prompts with source images), and edit data or rewards an edit model.
EDIT_MODELS = tuple(
    p.stem for p in (Path(CONF_DIR) / "model").glob("*.yaml") if get_family(OmegaConf.load(p).family).edit
)
EDIT_DATA = ("edits", "recolor")
EDIT_REWARDS = ("edit", "edit_consistency")
# A video model scores clips and a clip reward needs a video model (validation refuses mixing them).
VIDEO_MODELS = tuple(
    p.stem for p in (Path(CONF_DIR) / "model").glob("*.yaml") if get_family(OmegaConf.load(p).family).video
)
VIDEO_REWARDS = ("frame_brightness", "temporal_consistency")


def options(group):
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def compose_and_validate(choice: dict, tiny_cache, synthetic_pairs, tmp_path):
    """Compose `choice` (group -> option), with what a real model or offline DPO needs."""
    overrides = [f"{g}={o}" for g, o in choice.items()] + [f"model.cache_dir={tiny_cache}"]
    if choice.get("algorithm") == "dpo":
        overrides.append("data=pairs")
    if choice.get("algorithm") == "dpo" or choice.get("data") == "pairs":
        overrides.append(f"data.pairs={synthetic_pairs}")
    overrides += REWARD_NEEDS.get(choice.get("reward"), [])
    if choice.get("data") == "prompts":  # the user's own prompt files: data.train is theirs to name
        overrides.append(f"data.train={tmp_path / 'prompts.txt'}")
        (tmp_path / "prompts.txt").write_text("a red apple\na blue car\n")
    edit_model, edit_data = choice.get("model") in EDIT_MODELS, choice.get("data") in EDIT_DATA
    if (edit_model or choice.get("reward") in EDIT_REWARDS) and "data" not in choice:
        overrides.append("data=recolor")
    if (edit_data or choice.get("reward") in EDIT_REWARDS) and "model" not in choice:
        overrides.append("model=flux_kontext_tiny")
    if choice.get("data") == "edits":  # the user's own edit set: data.train is theirs to name
        overrides.append("data.train=omni:recolor_train")
    if choice.get("model") in set(VIDEO_MODELS) & set(EDIT_MODELS):  # image-to-video samples at its first frames' size
        overrides.append("model.resolution=64")  # the recolor scenes'
    if choice.get("model") in VIDEO_MODELS and "reward" not in choice:
        overrides.append("reward=frame_brightness")
    if choice.get("reward") in VIDEO_REWARDS and "model" not in choice:
        overrides.append("model=wan_tiny")
    cfg = compose_config(overrides, tmp_path)
    if choice.get("reward") in LOCAL_MODEL_REWARDS:
        # a learned reward's checkpoint is a local directory the user names: the error says which key
        with pytest.raises(
            ConfigError, match=f"reward.components.{choice['reward']}.path is mandatory and not set: pass"
        ):
            validate(cfg)
        return None
    if cfg.model.tiny_seed is None:
        cfg = compose_config(
            overrides + [f"model.path={get_family(cfg.model.family).tiny_path(tiny_cache, 0)}"], tmp_path
        )
    if choice.get("rollout") == "vllm" and engine_unavailable(VllmOptions()):
        # no vLLM-Omni engine env on this machine: the error says how to get one
        with pytest.raises(ConfigError, match="rollout=vllm: .*scripts/install_vllm_engine.sh"):
            validate(cfg)
        return None
    missing = missing_backends([backend.value for backend in cfg.logger.backends])
    if missing:  # an optional logger not installed here: the error names its extra
        with pytest.raises(ConfigError, match="logger.backends has .* not installed: pip install 'omni-recipes"):
            validate(cfg)
        return None
    return validate(cfg)


SINGLE = [(group, option) for group in GROUPS for option in options(group)]


@pytest.mark.parametrize("group,option", SINGLE, ids=[f"{g}={o}" for g, o in SINGLE])
def test_each_option_composes_and_validates(group, option, tiny_cache, synthetic_pairs, tmp_path):
    resolved = compose_and_validate({group: option}, tiny_cache, synthetic_pairs, tmp_path)
    if resolved is None:
        return
    family = get_family(resolved.model.family)
    assert set(resolved.model.fsdp.layer_prefixes) <= set(family.layer_prefixes)
    assert resolved.rollout.resolution is not None and resolved.rollout.guidance_scale is not None
    assert resolved.model.lora.target_modules


def model_algorithm_pairs():
    """The pair presets under omni/conf/model_algorithm/, as (model, algorithm) options."""
    pairs = []
    for name in options("model_algorithm"):
        model = next(
            m for m in options("model") if name.startswith(m + "_") and name[len(m) + 1 :] in options("algorithm")
        )
        pairs.append((model, name[len(model) + 1 :]))
    return pairs


PAIRS = model_algorithm_pairs()


@pytest.mark.parametrize("model,algorithm", PAIRS, ids=[f"{m}+{a}" for m, a in PAIRS])
def test_model_algorithm_preset_applies(model, algorithm, tiny_cache, synthetic_pairs, tmp_path):
    """The pair's own settings win over both groups' defaults."""
    from omegaconf import OmegaConf

    resolved = compose_and_validate({"model": model, "algorithm": algorithm}, tiny_cache, synthetic_pairs, tmp_path)
    preset = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model_algorithm" / f"{model}_{algorithm}.yaml"))
    for group, values in preset.items():
        if group == "defaults":
            continue
        for key, value in values.items():
            assert getattr(getattr(resolved, group), key) == pytest.approx(value), f"{group}.{key}"


def test_dpo_without_pairs_says_what_to_set(tiny_cache, tmp_path):
    with pytest.raises(ConfigError, match="data=pairs and set data.pairs"):
        validate(compose_config(["algorithm=dpo", f"model.cache_dir={tiny_cache}"], tmp_path))


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), f"omni/conf/{group}/ has no options"


def test_unknown_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["algorithm.clip_rnge=0.1"])
    assert "clip_rnge" in str(info.value.__cause__ or info.value)


APPENDED = [
    (
        "+reward.weights.aesthetic=1.0",
        "reward.weights: no such key (the schema of reward has aggregation, batch_size, components",
    ),
    ("+trainer.lr_warmup=10", "trainer.lr_warmup: no such key"),
    ("+reward.components.brightness.wieght=2", "reward.components.brightness.wieght: no such key"),
    ("+model.lora.dropout=0.1", "model.lora.dropout: no such key"),
]


@pytest.mark.parametrize("override,message", APPENDED, ids=[o for o, _ in APPENDED])
def test_appended_unknown_key_fails_naming_it(override, message, tmp_path):
    """`+key=value` gets past Hydra's struct check; the schema still refuses the key."""
    with pytest.raises(ConfigError) as info:
        validate(compose_config([override], tmp_path))
    assert str(info.value).startswith(message)


def test_wrong_type_fails_naming_it():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["model.lora.rank=eight"])
    assert "model.lora.rank" in str(info.value.__cause__ or info.value)


def test_algorithm_schema_is_specific():
    cfg = compose_config(["algorithm=flow_grpo_fast"])
    assert cfg.algorithm.sde_window_size == 2
    assert list(cfg.algorithm.sde_window_range) == [0, 5]


def test_mix_grpo_flash_is_mix_grpo_with_the_dpm2_solver(tmp_path):
    """The preset sets the rollout's ODE solver (the command line still overrides it) and is
    otherwise MixGRPO, model pair preset included."""
    flash = validate(compose_config(["algorithm=mix_grpo_flash"], tmp_path))
    assert flash == validate(compose_config(["algorithm=mix_grpo", "rollout.ode_solver=dpm2"], tmp_path))
    assert flash.rollout.ode_solver.value == "dpm2" and flash.algorithm.name == "mix_grpo" and flash.trainer.lr == 1e-2
    assert validate(compose_config(["algorithm=mix_grpo"], tmp_path)).rollout.ode_solver.value == "euler"
    assert (
        compose_config(["algorithm=mix_grpo_flash", "rollout.ode_solver=euler"], tmp_path).rollout.ode_solver == "euler"
    )


def test_cfg_job_prints_the_composed_config():
    result = cli_process.run(["recipes/train.py", "--cfg", "job", "algorithm=flow_grpo_fast", "reward=multi"])
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "sde_window_size: 2" in out and "jpeg_compressibility:" in out and "weight: 0.5" in out
