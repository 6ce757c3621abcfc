"""Splitting work over the workers of a group and joining their results.

Rollouts split prompts and seeds into contiguous parts (the engine seeds each image by its
own seed, so an image does not depend on the split). Updates split the batch into equal
contiguous shards: every worker runs the same number of forward and backward passes, which
FSDP's collectives need, and the mean over each shard, averaged by FSDP, is the mean over
the batch.
"""

from __future__ import annotations

from typing import Dict, List, Sequence


def split_evenly(n: int, parts: int) -> List[slice]:
    """`parts` contiguous slices of range(n), sizes differing by at most one."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def equal_shards(n: int, parts: int) -> List[slice]:
    """`parts` contiguous slices of range(n) of the same size; n must be a multiple of parts."""
    if n % parts:
        raise ValueError(f"{n} rows do not split into {parts} equal shards")
    return split_evenly(n, parts)


def mean_metrics(per_worker: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """The mean of each metric over the workers (their shards are equal, so this is the
    batch's mean; a global quantity such as the gradient norm is the same on every worker)."""
    keys = per_worker[0].keys()
    return {key: sum(m[key] for m in per_worker) / len(per_worker) for key in keys}
