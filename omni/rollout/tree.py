"""TreeGRPO's rollout: each prompt's group sampled as one tree of denoising trajectories.

A tree grows from one initial noise (its group's seed). It follows the ODE, one trajectory,
until its first branch step b_0, where the SDE step is taken k_0 times from the same latent
with k_0 different noises: k_0 children that share everything before. Each child follows the
ODE to the next branch step, splits into k_1, and so on; the leaves, prod k_d of them, are
the group's images. Every latent before a branch point is computed once and shared by all
the leaves under it (stored once per leaf, bit-identical), so step i evaluates the
transformer on

    w_i = prod over branch depths d with b_d < i of k_d      latents per tree

(a branch step evaluates its one velocity before it splits), sum_i w_i in all, against
leaves x num_steps for independent samples.

Randomness is per tree and per node, so a tree does not depend on how the batch is split:
the root noise is the one an independent sample with the tree's seed starts from, and the
noise of child c (numbered across its depth, in leaf order) at branch step b is drawn from a
generator seeded with `seeding.derive_seed(seed, b x leaves + c, seeding.TREE_BRANCH)`.

Rows come out in leaf order: leaf l's branch at depth d is digit d of l in the mixed radix
(k_0, ..., k_{D-1}), the first the most significant, so the leaves under a node are
contiguous. A branch step's log-prob is that of the step into each leaf's own child; the
ODE steps have log-prob 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from omni import seeding
from omni.models.base import Conditioning, ModelFamily
from omni.rollout.base import SamplingOptions
from omni.rollout.ode import ODESolver
from omni.rollout.sde import sde_step


@dataclass(frozen=True)
class Tree:
    """A tree's shape: the denoising steps it branches at, increasing, and the children per
    node at each."""

    steps: Tuple[int, ...]
    children: Tuple[int, ...]

    @classmethod
    def of(cls, pairs: Sequence[Tuple[int, int]]) -> "Tree":
        """From `SamplingOptions.tree`'s (step, children) pairs."""
        return cls(tuple(int(s) for s, _ in pairs), tuple(int(k) for _, k in pairs))

    @property
    def leaves(self) -> int:
        return math.prod(self.children)

    def subtree(self, depth: int) -> int:
        """Leaves under a node made at branch depth `depth`."""
        return math.prod(self.children[depth + 1 :])

    def width(self, step: int) -> int:
        """Latents of one tree that denoising step `step` evaluates (w_i above)."""
        return math.prod(k for b, k in zip(self.steps, self.children) if b < step)

    def evaluations(self, num_steps: int) -> int:
        """Transformer evaluations of one tree over `num_steps` steps (sum_i w_i)."""
        return sum(self.width(i) for i in range(num_steps))

    def edges(self) -> int:
        """Transitions into a node, over every branch depth: the tree's trainable steps."""
        return sum(self.leaves // self.subtree(d) for d in range(len(self.steps)))


def branch_noise(family: ModelFamily, pipe, roots: Sequence[int], step: int, width: int, leaves: int, options):
    """The noise of each child made at `step` (`width` per tree), trees in order: (n x width, ...)."""
    generators = [
        torch.Generator().manual_seed(seeding.derive_seed(int(seed), step * leaves + c, seeding.TREE_BRANCH))
        for seed in roots
        for c in range(width)
    ]
    return family.initial_latents(pipe, generators, options.resolution, options.num_frames)


def chunked_velocity(family, transformer, x, sigma, cond: Conditioning, options, dtype, size: int) -> torch.Tensor:
    """The velocity of `x` in forward passes of at most `size` latents (a late step of a big
    tree holds more latents than a micro-batch)."""
    parts = [
        family.predict_velocity(
            transformer,
            x[s : s + size].to(dtype),
            sigma[s : s + size],
            cond.apply(lambda t, s=s: t[s : s + size]),
            options.guidance_scale,
        )
        for s in range(0, len(x), size)
    ]
    return torch.cat(parts)


@torch.no_grad()
def grow_trees(
    family: ModelFamily,
    pipe,
    cond: Conditioning,
    roots: Sequence[int],
    sigmas: torch.Tensor,
    options: SamplingOptions,
    micro_batch_size: int,
    device,
    dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trees from seeds `roots`, `cond` one row per tree: (latents (n x leaves, T+1, ...),
    log_probs (n x leaves, T), images), fp32 on the CPU, leaves in order within each tree."""
    tree = Tree.of(options.tree)
    branching = dict(zip(tree.steps, tree.children))
    generators = [torch.Generator().manual_seed(int(s)) for s in roots]
    x = family.initial_latents(pipe, generators, options.resolution, options.num_frames).to(device, torch.float32)
    states, log_probs, width = [x.cpu()], [], 1
    ode = ODESolver(options.ode_solver)
    for i in range(options.num_steps):
        velocity = chunked_velocity(
            family, pipe.transformer, x, sigmas[i].expand(len(x)).to(device), cond, options, dtype, micro_batch_size
        )
        k = branching.get(i)
        if k is None:
            x, log_prob = ode.step(velocity, x, sigmas[i], sigmas[i + 1]), torch.zeros(len(x) * tree.leaves // width)
        else:
            width *= k
            noise = branch_noise(family, pipe, roots, i, width, tree.leaves, options).to(device, torch.float32)
            x, log_prob, _, _ = sde_step(
                velocity.repeat_interleave(k, 0), x.repeat_interleave(k, 0), sigmas[i], sigmas[i + 1],
                float(sigmas[1]), options.noise_level, noise=noise, sde_type=options.sde_type,
            )  # fmt: skip
            cond = cond.apply(lambda t, k=k: t.repeat_interleave(k, 0))
            ode.reset()
            log_prob = log_prob.cpu().repeat_interleave(tree.leaves // width)
        states.append(x.cpu())
        log_probs.append(log_prob)
    # each tree's w latents at a step, each repeated for the leaves under it (rows are tree-major)
    latents = torch.stack([s.repeat_interleave(len(roots) * tree.leaves // len(s), 0) for s in states], 1)
    images = family.decode(pipe, x, options.resolution)
    return latents, torch.stack(log_probs, 1), images.cpu()


def sample_trees(
    family: ModelFamily,
    pipe,
    prompts: Sequence[str],
    seeds: Sequence[int],
    cond: Conditioning,
    sigmas: torch.Tensor,
    options: SamplingOptions,
    micro_batch_size: int,
    device,
    dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tree of a batch whose rows come in groups of the tree's leaves, one prompt and
    seed per group, as many trees at a time as fill `micro_batch_size` leaves (one at least):
    (latents, log_probs, images) as `grow_trees` returns them, in the rows' order."""
    leaves = Tree.of(options.tree).leaves
    if len(prompts) % leaves:
        raise ValueError(f"{len(prompts)} rows do not split into trees of {leaves} leaves")
    for start in range(0, len(prompts), leaves):
        if len(set(prompts[start : start + leaves])) > 1 or len(set(seeds[start : start + leaves])) > 1:
            raise ValueError(f"rows {start} to {start + leaves - 1} are one tree: one prompt and one seed for all")
    per_call = max(1, micro_batch_size // leaves) * leaves
    parts = [
        grow_trees(
            family,
            pipe,
            cond.apply(lambda t, s=s: t[s : s + per_call : leaves]),
            seeds[s : s + per_call : leaves],
            sigmas,
            options,
            micro_batch_size,
            device,
            dtype,
        )
        for s in range(0, len(prompts), per_call)
    ]
    return tuple(torch.cat(p) for p in zip(*parts))
