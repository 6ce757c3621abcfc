"""The order in which offline DPO sees its pairs, and the DataLoader that decodes them.

Pairs are numbered by position among the good rows of the data (`pair_sources.scan`).
`split_positions` holds out a seeded share of them; the train positions are then walked in
a new seeded permutation each epoch, and `batch_positions(consumed, n)` names the `n` pairs
after the first `consumed`, so the data position of a run is one integer (pairs consumed)
that a checkpoint stores. With a constant batch size this is the order the in-memory loader
used (`items_for_step` over the train pairs).

`PairImages` is a map-style dataset over a `PairSource`: a batch of positions is read and
decoded in a DataLoader worker (`data.num_workers`), resized and centre-cropped to the
resolution, and collated into uint8-exact float images. Only the row numbers of the data
are held in memory, never its images.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from omni import seeding
from omni.data.pair_sources import PairSource, bad_row_message
from omni.data.preferences import BadRow, decode_row, images_to_uint8, uint8_to_batch

logger = logging.getLogger(__name__)


def split_positions(n_pairs: int, eval_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """A seeded split of positions 0..n_pairs-1 into (train, held-out); at least one pair on
    each side when `eval_fraction` > 0."""
    order = torch.randperm(n_pairs, generator=torch.Generator().manual_seed(seed)).numpy()
    n_eval = min(max(1, round(n_pairs * eval_fraction)), n_pairs - 1) if eval_fraction > 0 else 0
    return order[n_eval:], order[:n_eval]


def epoch_order(n: int, epoch: int, seed: int) -> torch.Tensor:
    """The seeded permutation of `n` train pairs for `epoch` (the prompts' rule, `items_for_step`)."""
    return torch.randperm(n, generator=seeding.seeded_generator(seed, epoch, seeding.EPOCH_ORDER))


def batch_positions(consumed: int, n: int, n_train: int, seed: int) -> List[int]:
    """Indices into the train positions of the `n` pairs after the first `consumed`."""
    picked, orders = [], {}
    for position in range(consumed, consumed + n):
        epoch, index = divmod(position, n_train)
        if epoch not in orders:
            orders[epoch] = epoch_order(n_train, epoch, seed)
        picked.append(int(orders[epoch][index]))
    return picked


class TrainBatches:
    """Batch sampler: the train indices of each step from `consumed` pairs on, forever."""

    def __init__(self, consumed: int, batch_size: int, n_train: int, seed: int):
        self.consumed, self.batch_size, self.n_train, self.seed = consumed, batch_size, n_train, seed

    def __iter__(self) -> Iterator[List[int]]:
        consumed = self.consumed
        while True:
            yield batch_positions(consumed, self.batch_size, self.n_train, self.seed)
            consumed += self.batch_size


@dataclass
class DecodedPairs:
    """A batch of decoded pairs: prompts and (B, 3, R, R) float images in [0, 1]."""

    prompts: List[str]
    chosen: Optional[torch.Tensor]
    rejected: Optional[torch.Tensor]
    dropped: List[str] = field(default_factory=list)  # why each unreadable pair left the batch
    kept: List[int] = field(default_factory=list)  # which of the batch's pairs these are

    def __len__(self) -> int:
        return len(self.prompts)


class PairImages(Dataset):
    """Pairs at `positions` (indices into the good rows `rows` of `source`), decoded lazily."""

    def __init__(
        self,
        source: PairSource,
        rows: np.ndarray,
        positions: np.ndarray,
        resolution: int,
        key: str,
        skip_bad_rows: bool,
    ):
        self.source, self.rows, self.positions = source, rows, positions
        self.resolution, self.key, self.skip_bad_rows = resolution, key, skip_bad_rows

    def __len__(self) -> int:
        return len(self.positions)

    def _decode(self, row: int, values):
        """(prompt, chosen, rejected) with uint8 (R, R, 3) images, or why the pair is
        unreadable (when skipping)."""
        try:
            if isinstance(values, BadRow):
                raise values
            pair = decode_row(values, self.source.base_dir, self.source.num_frames)
        except BadRow as error:  # a body that fails to decode behind the header the scan read
            message = bad_row_message(self.source, row, self.key, error)
            if not self.skip_bad_rows:
                raise ValueError(message) from error
            return message
        images = images_to_uint8([pair.chosen, pair.rejected], self.resolution)
        return pair.prompt, images[0], images[1]

    def __getitems__(self, indices: Sequence[int]) -> list:
        rows = self.rows[self.positions[np.asarray(indices, dtype=np.int64)]]
        return [self._decode(int(row), values) for row, values in zip(rows, self.source.rows(rows))]

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]


def collate_pairs(items: list) -> DecodedPairs:
    kept = [i for i, item in enumerate(items) if not isinstance(item, str)]
    good = [items[i] for i in kept]
    dropped = [item for item in items if isinstance(item, str)]
    if not good:
        return DecodedPairs([], None, None, dropped, kept)
    # the numbers and memory layout `images_to_tensor` gives
    stack = lambda side: uint8_to_batch(torch.stack([item[side] for item in good]))  # noqa: E731
    return DecodedPairs([item[0] for item in good], stack(1), stack(2), dropped, kept)


def pair_loader(dataset: Dataset, batch_sampler, num_workers: int, collate_fn=collate_pairs) -> DataLoader:
    """A DataLoader that yields `DecodedPairs`, in the sampler's order whatever the workers.
    It has a generator of its own: starting it draws its workers' seed, which from the global
    generator would shift what training draws after (LoRA dropout)."""
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        prefetch_factor=2 if num_workers else None,
        generator=torch.Generator().manual_seed(0),
    )


def chunks(n: int, size: int) -> List[List[int]]:
    """0..n-1 in consecutive chunks of `size`."""
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]
