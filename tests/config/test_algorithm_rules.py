"""Options of the algorithms and samplers that do not go together fail at validation, before
any model loads, naming both keys."""

import pytest

from omni.validation import ConfigError, validate
from tests.conftest import compose_config

BAD = {
    "cps eta above 1": (
        ["rollout.sde_type=cps", "rollout.noise_level=1.5"],
        ["rollout.noise_level", "rollout.sde_type=cps"],
    ),
    "cps window on the last step": (
        ["rollout.sde_type=cps", "algorithm=flow_grpo_fast", "algorithm.sde_window_range=[0,8]"],
        ["algorithm.sde_window_range", "rollout.sde_type=cps"],
    ),
    "cps window too wide": (
        [
            "rollout.sde_type=cps",
            "algorithm=flow_grpo_fast",
            "algorithm.sde_window_size=10",
            "algorithm.sde_window_range=null",
        ],
        ["algorithm.sde_window_size", "rollout.sde_type=cps"],
    ),
    "unknown sde type": (["rollout.sde_type=ddim"], ["rollout.sde_type"]),
    "unknown advantage normalisation": (["algorithm.adv_norm=batch"], ["algorithm.adv_norm"]),
    "unknown kl type": (["algorithm.kl_type=score"], ["algorithm.kl_type"]),
    "ema decay of 1": (["trainer.ema_decay=1.0"], ["trainer.ema_decay=1.0", "(0, 1)"]),
    "ema decay of 0": (["trainer.ema_decay=0"], ["trainer.ema_decay=0", "(0, 1)"]),
    "cps with diffusion_nft": (
        ["algorithm=diffusion_nft", "rollout.sde_type=cps"],
        ["rollout.sde_type=cps", "algorithm=diffusion_nft"],
    ),
    "cfg with diffusion_nft": (
        ["algorithm=diffusion_nft", "rollout.guidance_scale=4.5"],
        ["rollout.guidance_scale", "algorithm=diffusion_nft"],
    ),
    "mix_grpo window larger than the steps": (
        ["algorithm=mix_grpo", "algorithm.sde_window_size=11"],
        ["algorithm.sde_window_size=11", "rollout.num_steps=10"],
    ),
    "mix_grpo window with a range": (
        ["algorithm=mix_grpo", "algorithm.sde_window_range=[0,2]"],
        ["algorithm.sde_window_range"],
    ),
    "dppo threshold": (["algorithm=flow_dppo", "algorithm.kl_mask_threshold=0"], ["algorithm.kl_mask_threshold"]),
    "dppo has no clip range": (["algorithm=flow_dppo", "algorithm.clip_range=0.1"], ["algorithm.clip_range"]),
    "cps with dgpo": (["algorithm=dgpo", "rollout.sde_type=cps"], ["rollout.sde_type=cps", "algorithm=dgpo"]),
    "dgpo beta": (["algorithm=dgpo", "algorithm.beta=0"], ["algorithm.beta=0"]),
    "dgpo clip range of 0": (["algorithm=dgpo", "algorithm.clip_range=0"], ["algorithm.clip_range=0", "(0, 1)"]),
    "dgpo clip range of 1": (["algorithm=dgpo", "algorithm.clip_range=1"], ["algorithm.clip_range=1", "(0, 1)"]),
    "dgpo clip range not a number": (["algorithm=dgpo", "algorithm.clip_range=wide"], ["algorithm.clip_range"]),
    "dgpo negative kl": (["algorithm=dgpo", "algorithm.kl_coef=-0.1"], ["algorithm.kl_coef=-0.1"]),
    "dgpo noise levels": (["algorithm=dgpo", "algorithm.timesteps_per_group=0"], ["algorithm.timesteps_per_group=0"]),
    "dgpo more minibatches than units": (
        ["algorithm=dgpo", "algorithm.num_minibatches=9"],  # 4 prompts x 2 noise levels
        ["algorithm.num_minibatches=9", "algorithm.timesteps_per_group"],
    ),
    "dgpo groups split over workers": (
        ["algorithm=dgpo", "trainer.n_workers=8"],  # 32 images in groups of 8: 4 prompts
        ["algorithm=dgpo", "trainer.n_workers=8", "algorithm.group_size=8"],
    ),
    "unknown reward aggregation": (["reward=multi", "reward.aggregation=mean"], ["reward.aggregation"]),
    "gdpo with one reward": (
        ["reward.aggregation=gdpo"],
        ["reward.aggregation=gdpo", "reward.components", "brightness"],
    ),
    "gdpo with one weighted reward": (
        ["reward=multi", "reward.aggregation=gdpo", "reward.components.jpeg_compressibility.weight=0"],
        ["reward.aggregation=gdpo", "reward.components"],
    ),
    "gdpo without groups": (
        ["reward=multi", "reward.aggregation=gdpo", "algorithm=dpo", "data=pairs", "data.pairs=/tmp"],
        ["reward.aggregation=gdpo", "algorithm=dpo", "algorithm.group_size"],
    ),
    "gdpo without the std division": (
        ["reward=multi", "reward.aggregation=gdpo", "algorithm.adv_norm=none"],
        ["reward.aggregation=gdpo", "algorithm.adv_norm=none"],
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_combination_names_its_keys(case, tmp_path):
    overrides, keys = BAD[case]
    with pytest.raises(Exception) as error:
        validate(compose_config(overrides, tmp_path))
    text = str(error.value) + str(error.value.__cause__ or "")
    assert all(key in text for key in keys), text


GOOD = [
    ["rollout.sde_type=cps", "rollout.noise_level=1.0"],
    ["rollout.sde_type=cps", "algorithm=flow_grpo_fast"],  # the preset's window [0, 5] + 2 fits 9 stochastic steps
    ["algorithm.adv_norm=none", "algorithm.kl_type=velocity", "algorithm.kl_coef=0.1"],
    ["algorithm=grpo_guard", "rollout.sde_type=cps", "trainer.ema_decay=0.95"],
    ["algorithm=flow_dppo", "rollout.sde_type=cps", "algorithm.kl_coef=0.01"],
    ["algorithm=diffusion_nft", "algorithm.adv_norm=none"],
    # FLUX.1-dev's distilled guidance is one pass, not CFG: DiffusionNFT samples and trains with it
    ["model=flux_tiny", "algorithm=diffusion_nft", "rollout.guidance_scale=3.5"],
    # AWM on SDE samples of any stochastic step; full fine-tuning without its EMA snapshot
    ["algorithm=awm", "algorithm.sampler=sde", "rollout.sde_type=cps"],
    ["algorithm=awm", "model.lora=null", "algorithm.ema_kl_coef=0"],
    ["algorithm=gardo", "rollout.sde_type=cps", "algorithm.sde_window_size=2", "algorithm.gate_fraction=1"],
    # DPM-Solver++(2M) for ODE rollouts, and for evaluation under SDE-only algorithms
    ["algorithm=diffusion_nft", "rollout.ode_solver=dpm2"],
    ["algorithm=flow_grpo", "rollout.ode_solver=dpm2", "rollout.sde_type=cps"],
    # GDPO's advantages under every algorithm that samples groups
    ["reward=multi", "reward.aggregation=gdpo", "algorithm.adv_norm=global"],
    ["reward=multi", "reward.aggregation=gdpo", "algorithm=diffusion_nft"],
    ["reward=multi", "reward.aggregation=gdpo", "algorithm=online_dpo"],
    ["reward=multi", "reward.aggregation=gdpo", "algorithm=dgpo"],
    # DGPO's default mode: rollouts under CFG, the update without
    ["algorithm=dgpo", "rollout.guidance_scale=4.5", "algorithm.num_minibatches=8"],
    # DGPO without its authors' stabilisers: the group preference objective alone
    ["algorithm=dgpo", "algorithm.clip_range=null", "algorithm.kl_coef=0"],
]


@pytest.mark.parametrize("overrides", GOOD, ids=lambda o: " ".join(o))
def test_compatible_options_validate(overrides, tmp_path):
    validate(compose_config(overrides, tmp_path))


def test_config_error_is_the_type_raised(tmp_path):
    with pytest.raises(ConfigError):
        validate(compose_config(BAD["cps eta above 1"][0], tmp_path))
