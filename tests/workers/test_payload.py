"""What a worker of a group is sent for an update: its own rows of the tensors the update
reads, not views that carry the whole batch's buffers, and no images."""

import pickle

import torch

from omni.algorithms.dpo import PairBatch
from omni.algorithms.flow_grpo import GRPOBatch
from omni.fsdp_utils import state_nbytes
from omni.models.sd3 import PromptEmbeds
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.workers.batching import equal_shards

N, STEPS = 16, 10


def cond(n):
    return PromptEmbeds(torch.randn(n, 16, 64), torch.randn(n, 64), torch.randn(n, 16, 64), torch.randn(n, 64))


def nbytes(*tensors) -> int:
    return state_nbytes(tensors)


def test_a_grpo_shard_carries_only_its_rows_and_no_images():
    options = SamplingOptions(STEPS, 64, 4.5, 0.7, 16, (0, STEPS))
    rollout = RolloutBatch(
        ["p"] * N,
        torch.rand(N, 3, 64, 64),
        torch.randn(N, STEPS + 1, 4, 8, 8),
        torch.randn(N, STEPS),
        torch.linspace(1, 0, STEPS + 1),
        cond(N),
        options,
    )
    batch = GRPOBatch(rollout, torch.randn(N))
    for rows in equal_shards(N, 2):
        shard = batch.select(rows)
        needed = nbytes(
            rollout.latents[rows],
            rollout.log_probs[rows],
            batch.advantages[rows],
            *shard.rollout.cond.tensors().values(),
        )
        assert shard.rollout.images is None
        assert len(pickle.dumps(shard)) <= needed + 8_192  # plus the sigmas, options and pickle framing


def test_a_pair_shard_carries_only_its_rows():
    pairs = PairBatch(torch.randn(N, 4, 8, 8), torch.randn(N, 4, 8, 8), cond(N))
    rows = slice(0, N // 2)
    shard = pairs.select(rows)
    needed = nbytes(pairs.x0_chosen[rows], pairs.x0_rejected[rows], *shard.cond.tensors().values())
    assert len(pickle.dumps(shard)) <= needed + 4_096
