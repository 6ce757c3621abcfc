"""The tiny SD3's actor-rollout worker, built once for the update tests of every algorithm."""

import pytest
import torch

from omni.validation import validate
from tests.conftest import compose_config


@pytest.fixture(scope="session")
def worker(tiny_cache, tmp_path_factory):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    cfg = validate(
        compose_config([f"model.cache_dir={tiny_cache}", "trainer.micro_batch_size=64"], tmp_path_factory.mktemp("run"))
    )
    worker = ActorRolloutWorker(cfg, model_path(cfg.model))
    worker.setup()
    yield worker
    worker.shutdown()


@pytest.fixture
def fresh(worker):
    """The session's worker with its LoRA, optimizer and KL weight restored after the test."""
    lora = [p.detach().clone() for p in worker.trainable]
    optimizer = worker.optimizer.state_dict()
    kl_coef, kl_type = worker.cfg.algorithm.kl_coef, worker.cfg.algorithm.kl_type
    yield worker
    with torch.no_grad():
        for p, saved in zip(worker.trainable, lora):
            p.copy_(saved)
    worker.optimizer.load_state_dict(optimizer)
    worker.cfg.algorithm.kl_coef, worker.cfg.algorithm.kl_type = kl_coef, kl_type
    worker.sync_weights()
