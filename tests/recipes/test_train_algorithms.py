"""The newer algorithms and options through the real CLI on the tiny SD3: the held-out reward
rises. Two runs at once cover GRPO-Guard with Coefficients-Preserving Sampling, and Flow-DPPO
with the velocity KL and an EMA-evaluated LoRA (`scripts/compare_algorithms.py` runs each one
alone, over seeds)."""

import pytest

from tests.recipes.test_train import paired_gain, train_in_parallel

RUNS = {
    "grpo_guard_cps": ["algorithm=grpo_guard", "rollout.sde_type=cps"],
    "flow_dppo_velocity_kl_ema": ["algorithm=flow_dppo", "algorithm.kl_type=velocity", "algorithm.kl_coef=0.1", "trainer.ema_decay=0.9"],
}


@pytest.mark.slow
def test_newer_algorithms_raise_held_out_reward(tmp_path, tiny_cache):
    runs = {tmp_path / name: (1, overrides) for name, overrides in RUNS.items()}
    train_in_parallel(runs, tiny_cache)
    for run_dir in runs:
        gain, t_stat = paired_gain(run_dir)
        assert gain > 0 and t_stat > 3, f"{run_dir.name}: mean gain {gain:.5f}, t={t_stat:.2f}"
