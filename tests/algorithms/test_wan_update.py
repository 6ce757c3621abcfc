"""Flow-GRPO on the tiny Wan (5-D video latents, CFG's two passes), through the real worker:
after a real weight sync the actor re-scores the engine's clips to 1e-5 (every step, and in
Flow-GRPO-Fast's window with no log-prob outside it), and one update raises the log-prob of
the clip with a positive advantage and lowers the other's."""

import pytest
import torch

from omni.algorithms import flow_grpo
from tests.workers.test_actor_rollout import make_worker, randomise_lora, rescore, rollout

WAN = [
    "model=wan_tiny",
    "reward=frame_brightness",
    "model.guidance_scale=2.0",
    "rollout.share_actor=false",
    "rollout.num_steps=4",
]


@pytest.mark.parametrize("algorithm", ["flow_grpo", "flow_grpo_fast"])
def test_actor_log_probs_match_engine_after_sync(algorithm, tiny_cache, tmp_path):
    cfg, worker = make_worker(tiny_cache, tmp_path, *WAN, f"algorithm={algorithm}", "algorithm.sde_window_range=[0,2]")
    try:
        randomise_lora(worker)
        stale = rollout(cfg, worker, step=1)
        actor, engine, _ = rescore(worker, stale)
        assert (actor - engine).abs().max() > 1e-4  # not synced yet: the check below can fail
        worker.sync_weights()
        batch = rollout(cfg, worker, step=1)
        assert batch.latents.shape[2:] == (16, 2, 4, 4) and batch.images.shape[1:] == (5, 3, 32, 32)
        actor, engine, _ = rescore(worker, batch)
        assert len(actor) > 0 and torch.isfinite(actor).all()
        assert (actor - engine).abs().max() <= 1e-5
        start, stop = batch.options.sde_steps
        outside = [j for j in range(cfg.rollout.num_steps) if not start <= j < stop]
        assert (stop - start, bool(outside)) == ((2, True) if algorithm == "flow_grpo_fast" else (4, False))
        assert torch.all(batch.log_probs[:, outside] == 0)
    finally:
        worker.shutdown()


def test_update_raises_log_prob_of_positive_advantage_and_lowers_negative(tiny_cache, tmp_path):
    cfg, worker = make_worker(tiny_cache, tmp_path, *WAN)
    try:
        batch = rollout(cfg, worker, n=2)
        before = rescore(worker, batch, with_reference=False)[0].reshape(2, -1).mean(1)
        worker.apply_update(flow_grpo.update, flow_grpo.GRPOBatch(batch, torch.tensor([1.0, -1.0])), seed=0)
        worker.sync_weights()
        after, engine, _ = rescore(worker, rollout(cfg, worker, n=2), with_reference=False)
        assert (after - engine).abs().max() <= 1e-5  # the synced engine samples the updated policy
        after = rescore(worker, batch, with_reference=False)[0].reshape(2, -1).mean(1)
        assert after[0] > before[0] and after[1] < before[1], (before, after)
    finally:
        worker.shutdown()
