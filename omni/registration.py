"""Registering the schemas with Hydra's ConfigStore, by iterating the component registries.

`omni.config` holds the schemas and imports nothing above it; the components (rewards,
algorithms, rollout engines) declare their options beside their code, so storing them needs the
registries, and lives here, one layer up. Call `register_configs()` before composing.
"""

from hydra.core.config_store import ConfigStore

from omni.algorithms import ALGORITHMS
from omni.config import TrainConfig
from omni.config.rollout import RolloutConfig
from omni.rewards import REWARDS
from omni.rollout import ENGINES


def register_configs(schema: type = TrainConfig) -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent). `schema` types the whole run
    (`train_schema`, the first default of omni/conf/train.yaml): `omni-evaluate` passes
    `EvaluateConfig`, a TrainConfig with the checkpoint to evaluate."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=schema)
    for name in ALGORITHMS.names():  # each algorithm's options, declared on its class
        cs.store(group="schema/algorithm", name=name, node=ALGORITHMS.get(name).Options)
    for name in ENGINES.names():  # each engine's options (its own, or those every engine takes)
        cs.store(group="schema/rollout", name=name, node=getattr(ENGINES.module(name), "Options", RolloutConfig))
    for name in REWARDS.names():  # each reward's options, typed at composition
        cs.store(group="schema/reward", name=name, node=REWARDS.get(name).Options)
