"""TreeGRPO (Ding and Ye 2025, "TreeGRPO: Tree-Advantage GRPO for Online RL Post-Training of
Diffusion Models", arXiv:2512.08153): Flow-GRPO whose group is a tree of trajectories that
share their prefixes, and whose advantages are assigned per branching step.

Rollout (omni/rollout/tree.py). Each prompt's group grows from one seeded initial noise.
Denoising follows the ODE except at the branch steps b_0 < b_1 < ... (`branch_steps`), where
the SDE step is taken k_d times (`branching`) from the same latent with different noises.
The group is the tree's G = prod_d k_d leaves (the product must be `group_size`), and the
leaves under a node share every latent up to its branch step.

Advantages. The leaves' rewards are group-normalised as in GRPO (A_l, `adv_norm`,
`reward.aggregation`, clipped to +-`adv_clip_max`), then backed up the tree: the transition
into node n, made at branch step b_d, has the mean advantage of the leaves under n,

    A(n) = mean over valid leaves l under n of A_l

so the last branch step's transitions carry their own leaf's advantage, and an earlier one
the average outcome of the subtree it chose (the paper backs the normalised leaf rewards up
to every edge; the plain mean over a node's leaves is the aggregation here, with no parent's
value subtracted). Only the branch steps' transitions are trained,
each once (a node's transition is stored in the row of the first leaf under it), with
Flow-GRPO's clipped ratio, KL, minibatches and micro-batches (`flow_grpo.run_update`).

Cost against Flow-GRPO with the same group size G over T denoising steps (every step SDE):
both sample G images per prompt per update; Flow-GRPO evaluates the transformer G x T times
per prompt and trains G x T transitions, TreeGRPO evaluates

    sum_{i<T} w_i,   w_i = prod over d with b_d < i of k_d

latents per prompt (saving G x T - sum_i w_i; classifier-free guidance doubles both) and
trains sum_d prod_{e<=d} k_e transitions. The default, T = 10, branch steps (0, 2, 4) and
branching (2, 2, 2): 1 + 2 + 2 + 4 + 4 + 5 x 8 = 53 evaluations against 80 (27 saved, 34%),
and 2 + 4 + 8 = 14 trained transitions against 80.

    python recipes/train.py algorithm=tree_grpo
    python recipes/train.py algorithm=tree_grpo algorithm.group_size=9 algorithm.branching=[3,3] \
        algorithm.branch_steps=[0,3]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Tuple

import torch

from omni import seeding
from omni.algorithms.advantages import clip_advantages
from omni.algorithms.base import ScoredRollout, grouped_rollout
from omni.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig, GRPOBatch, check_cfg_gradient, check_groups, run_update
from omni.config.errors import require
from omni.config.rollout import InitialNoise
from omni.rollout.sde import noisy_steps
from omni.rollout.tree import Tree


@dataclass
class TreeGRPOConfig(FlowGRPOConfig):
    """TreeGRPO: Flow-GRPO on tree rollouts, advantages per branch step."""

    # The denoising steps the tree branches at (the only SDE steps), increasing.
    branch_steps: List[int] = field(default_factory=lambda: [0, 2, 4])
    # Children of each node at each branch step; their product is the group size.
    branching: List[int] = field(default_factory=lambda: [2, 2, 2])

    def __post_init__(self) -> None:
        """The rules on the tree's own fields; those that involve the rollout are
        TreeGRPO.check_config's."""
        steps, children = list(self.branch_steps), list(self.branching)
        require(
            len(steps) >= 1 and len(steps) == len(children),
            f"algorithm.branch_steps={steps} and algorithm.branching={children}: one branching factor per "
            "branch step, and at least one branch step",
        )
        require(
            all(b >= 0 for b in steps) and all(a < b for a, b in zip(steps, steps[1:])),
            f"algorithm.branch_steps={steps} must be distinct denoising steps >= 0, in increasing order",
        )
        require(all(k >= 2 for k in children), f"algorithm.branching={children}: each branch needs at least 2 children")
        require(
            math.prod(children) == self.group_size,
            f"algorithm.branching={children}: the product of algorithm.branching ({math.prod(children)}) must "
            f"equal algorithm.group_size={self.group_size} (the tree's leaves are the group)",
        )


def tree_of(algo) -> Tree:
    return Tree(tuple(algo.branch_steps), tuple(algo.branching))


def edge_advantages(leaf_advantages: torch.Tensor, valid: torch.Tensor, tree: Tree, num_steps: int) -> torch.Tensor:
    """(B, num_steps): at leaf i's branch step b_d, the mean advantage of the valid leaves
    under the node its path enters there (0 where none is valid); 0 on the other steps. Rows
    are trees of `tree.leaves` leaves in leaf order (omni.rollout.tree)."""
    leaves = tree.leaves
    advantages = torch.where(valid, leaf_advantages.float(), torch.zeros(())).reshape(-1, leaves)
    weights = valid.reshape(-1, leaves).float()
    out = torch.zeros(len(leaf_advantages), num_steps)
    for depth, step in enumerate(tree.steps):
        size = tree.subtree(depth)
        sums = advantages.reshape(len(advantages), -1, size).sum(dim=2)
        counts = weights.reshape(len(weights), -1, size).sum(dim=2)
        out[:, step] = (sums / counts.clamp(min=1)).repeat_interleave(size, dim=1).reshape(-1)
    return out


def edge_transitions(tree: Tree) -> Tuple[torch.Tensor, torch.Tensor]:
    """One tree's trainable transitions (row within the tree, step): at each branch depth,
    each node it makes there, in the row of the first leaf under it."""
    rows, steps = [], []
    for depth, step in enumerate(tree.steps):
        size = tree.subtree(depth)
        rows.append(torch.arange(0, tree.leaves, size))
        steps.append(torch.full((tree.leaves // size,), step))
    return torch.cat(rows), torch.cat(steps)


def edge_minibatches(tree: Tree, n_samples: int, num_minibatches: int, seed: int, first: int = 0):
    """(samples, steps) of each minibatch of one pass over `n_samples` rows of whole trees,
    the first at row `first` of the whole batch. As `flow_grpo.minibatch_rows` does for a
    sample's steps, each tree's transitions are shuffled by a generator seeded with `seed` and
    the tree's index in the whole batch, and minibatch m takes the m-th share of each tree's:
    a worker holding whole trees builds its share of the plan one worker builds for all."""
    if n_samples % tree.leaves or first % tree.leaves:
        raise ValueError(f"rows [{first}, {first + n_samples}) are not whole trees of {tree.leaves} leaves")
    rows, steps = edge_transitions(tree)
    samples: List[List[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    chosen: List[List[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    for t in range(n_samples // tree.leaves):
        index = first // tree.leaves + t
        generator = torch.Generator().manual_seed(seeding.derive_seed(seed, index, seeding.SAMPLE_STEPS) % 2**63)
        order = torch.randperm(len(rows), generator=generator)
        for m, share in enumerate(order.tensor_split(num_minibatches)):
            samples[m].append(rows[share] + t * tree.leaves)
            chosen[m].append(steps[share])
    minibatches = [(torch.cat(s), torch.cat(j)) for s, j in zip(samples, chosen)]
    return [(s, j) for s, j in minibatches if len(s)]


def update(worker, batch: GRPOBatch, seed: int, first: int = 0, total: int = 0) -> Dict[str, float]:
    """Flow-GRPO's clipped-ratio update on the trees' branch transitions, each with its own
    advantage (`batch.advantages` is (B, T))."""
    return run_update(worker, batch, seed, first, plan=partial(edge_minibatches, tree_of(worker.cfg.algorithm)))


# ----------------------------------------------------------------- the step, on the driver
class TreeGRPO(FlowGRPO):
    """prompts -> one tree per prompt -> reward at the leaves -> advantages backed up the tree
    -> clipped-ratio update on the branch steps -> weight sync."""

    Options = TreeGRPOConfig  # its options: schema/algorithm/tree_grpo
    supports_async = False  # its rollout and its minibatch plan are its own

    update = staticmethod(update)

    @classmethod
    def check_config(cls, cfg) -> None:
        algo, rollout, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
        tree = tree_of(algo)
        require(algo.clip_range > 0, f"algorithm.clip_range={algo.clip_range} must be positive")
        check_groups(algo.group_size, trainer.batch_size)
        require(algo.num_inner_epochs >= 1, f"algorithm.num_inner_epochs={algo.num_inner_epochs} must be >= 1")
        check_cfg_gradient(cfg)
        require(
            algo.sde_window_size == 0 and algo.sde_window_range is None,
            "algorithm.sde_window_size / algorithm.sde_window_range: TreeGRPO's SDE steps are its branch steps "
            "(algorithm.branch_steps); leave them at 0 / null",
        )
        available = noisy_steps(rollout)
        cps = " (with rollout.sde_type=cps the last step, to sigma 0, cannot branch)"
        cps = cps if available < rollout.num_steps else ""
        require(
            tree.steps[-1] < available,
            f"algorithm.branch_steps={list(tree.steps)}: step {tree.steps[-1]} is outside [0, {available}), the "
            f"stochastic steps of rollout.num_steps={rollout.num_steps}{cps}",
        )
        require(
            1 <= algo.num_minibatches <= tree.edges(),
            f"algorithm.num_minibatches={algo.num_minibatches}: each tree's {tree.edges()} branch transitions are "
            f"shared out over the minibatches, so expected 1 to {tree.edges()}",
        )
        require(
            rollout.initial_noise == InitialNoise.per_image,
            "rollout.initial_noise=per_group with algorithm=tree_grpo: each group is one tree, grown from one "
            "initial noise already; leave rollout.initial_noise=per_image",
        )
        require(
            rollout.engine.value == "diffusers",
            f"algorithm=tree_grpo with rollout.engine={rollout.engine.value}: only the in-process engine grows "
            "trees; use rollout=diffusers",
        )
        prompts = trainer.batch_size // algo.group_size
        require(
            prompts % trainer.n_workers == 0,
            f"algorithm=tree_grpo samples and trains whole trees on each worker: trainer.batch_size="
            f"{trainer.batch_size} / algorithm.group_size={algo.group_size} = {prompts} trees do not split over "
            f"trainer.n_workers={trainer.n_workers}",
        )
        part = rollout.micro_batch_size * trainer.n_workers
        require(
            not cfg.reward.overlap or trainer.batch_size <= part or rollout.micro_batch_size % algo.group_size == 0,
            f"reward.overlap samples the rollout in parts of rollout.micro_batch_size={rollout.micro_batch_size} "
            f"images per worker, which would split a tree of algorithm.group_size={algo.group_size} leaves: make "
            "rollout.micro_batch_size a multiple of the group size, or set reward.overlap=false",
        )

    def rollout(self, step: int) -> ScoredRollout:
        """One tree per prompt (no SDE window: the branch steps are the SDE steps)."""
        tree = tree_of(self.cfg.algorithm)
        return grouped_rollout(self.ctx, step, tree.leaves, (0, 0), tuple(zip(tree.steps, tree.children)))

    def update_batch(self, rollout: ScoredRollout) -> Tuple[GRPOBatch, Dict[str, float]]:
        """The leaves' clipped group advantages, backed up to every branch transition."""
        algo = self.cfg.algorithm
        leaves, metrics = rollout.advantages(algo.group_size, self.cfg.reward.aggregation, algo.adv_norm)
        leaves = clip_advantages(leaves, algo.adv_clip_max)
        advantages = edge_advantages(leaves, rollout.valid, tree_of(algo), self.cfg.rollout.num_steps)
        for depth, step in enumerate(algo.branch_steps):  # how much credit each depth separates
            metrics[f"advantage_std_depth{depth}"] = float(advantages[:, step].std())
        return GRPOBatch(rollout.batch, advantages), metrics


ALGORITHM = TreeGRPO
