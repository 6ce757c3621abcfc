"""The training config composed outside a Hydra application: what `omni-train` composes from
the same overrides, for the tests, the scripts and the reward server.

    cfg = compose_train(["model=flux_tiny", "trainer.steps=2"])
"""

from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig


def compose_train(overrides: Sequence[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """`conf/train.yaml` with `overrides`, the schemas registered; with `return_hydra_config`,
    Hydra's own node too (a sweeper's settings)."""
    from hydra import compose, initialize_config_dir

    from omni.config import CONF_DIR
    from omni.registration import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=return_hydra_config)
