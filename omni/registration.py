"""Registering the schemas with Hydra's ConfigStore, by iterating the component registries.

`omni.config` holds the schemas and imports nothing above it; the components (rewards,
algorithms, ...) declare their options beside their code, so storing them needs the
registries, and lives here, one layer up. Call `register_configs()` before composing.
"""

from hydra.core.config_store import ConfigStore

from omni.algorithms import ALGORITHMS
from omni.config import TrainConfig
from omni.config.rollout import VllmRolloutConfig
from omni.rewards import REWARDS


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name in ALGORITHMS.names():  # each algorithm's options, declared on its class
        cs.store(group="schema/algorithm", name=name, node=ALGORITHMS.get(name).Options)
    cs.store(group="schema/rollout", name="vllm", node=VllmRolloutConfig)
    for name in REWARDS.names():  # each reward's options, typed at composition
        cs.store(group="schema/reward", name=name, node=REWARDS.get(name).Options)
