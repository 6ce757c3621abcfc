"""Registering the schemas with Hydra's ConfigStore, by iterating the component registries.

`omni.config` holds the schemas and imports nothing above it; the components (rewards,
algorithms, rollout engines) declare their options beside their code, so storing them needs the
registries, and lives here, one layer up. Call `register_configs()` before composing.
"""

import sys
from typing import Optional, Tuple

from hydra.core.config_store import ConfigStore

from omni.algorithms import ALGORITHMS
from omni.config import TrainConfig
from omni.config.rollout import RolloutConfig
from omni.rewards import REWARDS
from omni.rollout import ENGINES

# (schema, sys.path) of the last registration: storing every schema again (a structured config
# each) took a third of a composition
_registered: Optional[Tuple[type, Tuple[str, ...]]] = None


def register_configs(schema: type = TrainConfig) -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent; again only for another `schema`
    or another `sys.path`, where plugins may differ). `schema` types the whole run
    (`train_schema`, the first default of omni/conf/train.yaml): `omni-evaluate` passes
    `EvaluateConfig`, a TrainConfig with the checkpoint to evaluate."""
    global _registered
    key = (schema, tuple(sys.path))
    if _registered == key:
        return
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=schema)
    for name in ALGORITHMS.names():  # each algorithm's options, declared on its class
        cs.store(group="schema/algorithm", name=name, node=ALGORITHMS.get(name).Options)
    for name in ENGINES.names():  # each engine's options (its own, or those every engine takes)
        cs.store(group="schema/rollout", name=name, node=getattr(ENGINES.module(name), "Options", RolloutConfig))
    for name in REWARDS.names():  # each reward's options, typed at composition
        cs.store(group="schema/reward", name=name, node=REWARDS.get(name).Options)
    _registered = key
