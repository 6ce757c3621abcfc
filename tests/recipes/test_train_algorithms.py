"""The newer algorithms through the real CLI on the tiny SD3: the held-out reward rises. Two
runs at once, the two update paths: GRPO-Guard (Flow-GRPO's machinery with a regulated
ratio) and DiffusionNFT (forward-process training on ODE rollouts).
`scripts/compare_algorithms.py` runs every algorithm and option over seeds."""

import pytest

from tests.recipes.test_train import paired_gain, train_in_parallel

RUNS = {"grpo_guard": ["algorithm=grpo_guard"], "diffusion_nft": ["algorithm=diffusion_nft"]}


@pytest.mark.slow
def test_newer_algorithms_raise_held_out_reward(tmp_path, tiny_cache):
    runs = {tmp_path / name: (1, overrides) for name, overrides in RUNS.items()}
    train_in_parallel(runs, tiny_cache)
    for run_dir in runs:
        gain, t_stat = paired_gain(run_dir)
        assert gain > 0 and t_stat > 3, f"{run_dir.name}: mean gain {gain:.5f}, t={t_stat:.2f}"
