"""The three actor-rollout implementations offer every method of `ActorRollout`, and none
keeps a name the trainer uses for something else."""

import inspect

import pytest

from omni.workers.protocol import ActorRollout

METHODS = [name for name, value in vars(ActorRollout).items() if inspect.isfunction(value) and not name.startswith("_")]


def implementations():
    from omni.workers.actor_rollout import ActorRolloutWorker
    from omni.workers.ray_group import ActorRolloutGroup, RayActorRolloutWorker

    return [ActorRolloutWorker, RayActorRolloutWorker, ActorRolloutGroup]


@pytest.mark.parametrize("index", range(3))
def test_implements_the_protocol(index):
    cls = implementations()[index]
    for name in METHODS:
        theirs = inspect.signature(inspect.unwrap(getattr(cls, name)))
        ours = inspect.signature(getattr(ActorRollout, name))
        assert list(theirs.parameters)[: len(ours.parameters)] == list(ours.parameters), (cls.__name__, name)


def test_names_do_not_clash_with_the_trainer():
    from omni.trainer import Trainer

    trainer_methods = {name for name, _ in inspect.getmembers(Trainer, inspect.isfunction)}
    assert "apply_update" in METHODS and not trainer_methods & set(METHODS)
    for cls in implementations():
        assert not hasattr(cls, "train") and not hasattr(cls, "evaluate") and not hasattr(cls, "load_lora")
