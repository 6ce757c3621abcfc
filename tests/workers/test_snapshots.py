"""Snapshot adapters on the tiny SD3: frozen LoRA copies beside the trained adapter that the
update scores under (AWM's EMA of the policy, GARDO's reference that is reset). They start as
the untrained adapter (the base), load whole LoRA tensors, stay out of the optimizer and the
engine's sync, and a reference snapshot is the reference."""

import pytest
import torch

from omni.algorithms import flow_grpo
from omni.validation import validate
from omni.weights import REFERENCE_SNAPSHOT
from tests.conftest import compose_config
from tests.workers.test_actor_rollout import randomise_lora, rescore, rollout

OTHER = "other_snapshot"


@pytest.fixture(scope="module")
def snapshot_worker(tiny_cache, tmp_path_factory):
    from omni.trainer import model_path
    from omni.workers.actor_rollout import ActorRolloutWorker

    overrides = [f"model.cache_dir={tiny_cache}", "algorithm.kl_coef=0.1", "rollout.share_actor=false"]
    cfg = validate(compose_config(overrides, tmp_path_factory.mktemp("run")))
    worker = ActorRolloutWorker(cfg, model_path(cfg.model), snapshots=(REFERENCE_SNAPSHOT, OTHER))
    worker.setup()
    yield cfg, worker
    worker.shutdown()


def velocities(worker, batch, **kwargs):
    with torch.no_grad():
        latents = worker.to_device(batch.latents[:, 3])
        sigma = batch.sigmas[3].expand(len(batch))
        cond = batch.cond.apply(worker.to_device)
        return worker.velocity(latents, sigma, cond, batch.options.guidance_scale, **kwargs)


def test_snapshots_are_frozen_and_outside_the_optimizer_and_the_sync(snapshot_worker):
    _, worker = snapshot_worker
    adapter = worker.lora_cfg.adapter_name
    trainable = {n for n, p in worker.actor.named_parameters() if p.requires_grad}
    assert trainable and all(f".{adapter}." in n for n in trainable)
    snapshot_params = [n for n, _ in worker.actor.named_parameters() if f".{OTHER}." in n]
    assert len(snapshot_params) == len(trainable)
    assert sum(p.numel() for p in worker.trainable) == sum(
        p.numel() for n, p in worker.actor.named_parameters() if n in trainable
    )
    assert set(worker.lora_state_dict()) == {n.replace(f".{adapter}.", ".") for n in trainable}


def test_reference_snapshot_is_the_base_until_loaded_then_the_policy(snapshot_worker):
    """At set-up the reference snapshot is the untrained adapter (B = 0): the KL to it is 0.
    Once the policy moved the KL is positive, and loading the policy's LoRA into the snapshot
    (GARDO's reset) brings it back to exactly 0; the other snapshot stays at the base."""
    cfg, worker = snapshot_worker
    trained = [p.detach().clone() for p in worker.trainable]
    try:
        batch = rollout(cfg, worker)
        assert torch.all(rescore(worker, batch)[2] == 0)
        base = velocities(worker, batch, snapshot=OTHER)
        randomise_lora(worker)
        assert torch.all(rescore(worker, batch)[2] > 0)
        worker.load_snapshot(REFERENCE_SNAPSHOT, worker.lora_state_dict())
        assert torch.all(rescore(worker, batch)[2] == 0)
        assert torch.equal(velocities(worker, batch, reference=True), velocities(worker, batch))
        assert torch.equal(velocities(worker, batch, snapshot=OTHER), base)
        assert not torch.equal(base, velocities(worker, batch))
        # scoring under a snapshot leaves the trained adapter active and trainable
        assert all(p.requires_grad for p in worker.trainable)
    finally:
        with torch.no_grad():
            for p, saved in zip(worker.trainable, trained):
                p.copy_(saved)
        worker.load_snapshot(REFERENCE_SNAPSHOT, worker.lora_state_dict())


def test_an_update_leaves_the_snapshots_unchanged(snapshot_worker):
    cfg, worker = snapshot_worker
    snapshot = {n: p.detach().clone() for n, p in worker.actor.named_parameters() if "_snapshot." in n}
    batch = rollout(cfg, worker)
    metrics = worker.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, torch.tensor([1.0, -1, 0.5, -0.5])), 0)
    assert metrics["grad_norm"] > 0 and metrics["kl"] >= 0
    now = dict(worker.actor.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in snapshot.items())


def test_snapshot_names_are_checked(snapshot_worker):
    _, worker = snapshot_worker
    with pytest.raises(KeyError, match="no snapshot adapter 'absent'"):
        worker.load_snapshot("absent", worker.lora_state_dict())
    lora = worker.lora_state_dict()
    lora.pop(next(iter(lora)))
    with pytest.raises(KeyError, match="does not match snapshot"):
        worker.load_snapshot(OTHER, lora)


def reference_kl(worker, batch, seed, first=0, total=0):
    """An 'update' that only measures: the mean KL of the shard's transitions to the reference."""
    start, stop = batch.rollout.options.sde_steps
    n = len(batch)
    samples, steps = torch.arange(n).repeat_interleave(stop - start), torch.arange(start, stop).repeat(n)
    with torch.no_grad():
        _, kl = flow_grpo.score_transitions(worker, batch.rollout, samples, steps, True)
    return {"kl": float(kl.mean())}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [1, 2])
def test_a_reset_reference_is_the_policy_under_fsdp(fsdp, tiny_cache, tmp_path):
    """Two Ray workers sharding the transformer and both adapters: after an update the KL to
    the reference is positive; once the policy's whole LoRA is loaded into the reference
    snapshot it is 0 on every shard."""
    from omni.trainer import model_path
    from omni.workers import build_actor_rollout
    from tests.conftest import one_process_group_at_a_time, training_options

    overrides = [f"model.cache_dir={tiny_cache}", "trainer.n_workers=2", f"model.fsdp.version={fsdp}",
                 "trainer.batch_size=8", "algorithm.group_size=4", "rollout.num_steps=4",
                 "algorithm.kl_coef=0.1"]  # fmt: skip
    cfg = validate(compose_config(overrides, tmp_path))
    with one_process_group_at_a_time():
        group = build_actor_rollout(cfg, model_path(cfg.model), True, (REFERENCE_SNAPSHOT,))
        try:
            prompts = ["a red cat"] * 4 + ["a blue dog"] * 4
            batch = group.generate(prompts, list(range(8)), training_options(cfg, 0))
            grpo = flow_grpo.GRPOBatch(batch, torch.linspace(-1, 1, 8))
            assert group.apply_update(reference_kl, grpo, 0)["kl"] == 0
            group.apply_update(flow_grpo.update, grpo, 0)
            assert group.apply_update(reference_kl, grpo, 0)["kl"] > 0
            group.load_snapshot(REFERENCE_SNAPSHOT, group.lora_state_dict())
            assert group.apply_update(reference_kl, grpo, 0)["kl"] == 0
        finally:
            group.shutdown()
