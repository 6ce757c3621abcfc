"""Every seed a run derives from its own `seed`: one rule, one home.

A derived seed is `base * stream + index`: `base` is the seed it comes from, `index` what
varies (a step, an epoch, a row) and `stream` a prime of its own per use, so that two uses
with the same base and index draw different numbers. The primes are the ones the code used
before this module: the pinned checksums depend on every number drawn, so none changes.
The result is a plain integer (what `torch.Generator.manual_seed` takes below 2**64).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

STEP_IMAGES = 1_000_003  # a training step's (or the evaluation's) image seeds; index: the step
SAMPLE_STEPS = 1_000_003  # Flow-GRPO: one trajectory's SDE steps over the minibatches; index: its row
SCENE_IMAGES = 1_000_003  # a rendered scene image (scripts); index: the image
UPDATE = 15_485_863  # a training step's update (minibatch shuffles, DPO noise); index: the step
SDE_WINDOW = 7_919  # Flow-GRPO-Fast's window start; index: the step
EPOCH_ORDER = 100_003  # the shuffle of prompts or preference pairs; index: the epoch
MINIBATCHES = 1_009  # an update's minibatch plan and DiffusionNFT's noise; index: the epoch or first row
TREE_BRANCH = 104_729  # TreeGRPO: a branch's noise; base: its tree's seed, index: (step, child)
EVAL_CHUNK = 1_000_000_007  # a held-out DPO chunk's noise; base: the chunk, index: eval.seed


def derive_seed(base: int, index: int, stream: int) -> int:
    """`base * stream + index`: the seed of `index` in `stream`, derived from `base`."""
    return base * stream + index


def group_member_seeds(group_seeds: Sequence[int], group_size: int) -> List[int]:
    """The seeds of groups' members, `group_size` per group seed: member k of the group of seed
    s has s * group_size + k, so each member knows its group's seed (`group_seed`) alone, in
    any micro-batch or worker's shard."""
    return [s * group_size + k for s in group_seeds for k in range(group_size)]


def group_seed(member_seed: int, group_size: int) -> int:
    """The seed of the group a `group_member_seeds` seed belongs to."""
    return member_seed // group_size


def seeded_generator(base: int, index: int, stream: int) -> torch.Generator:
    """A CPU generator seeded with `derive_seed(base, index, stream)`."""
    return torch.Generator().manual_seed(derive_seed(base, index, stream))
