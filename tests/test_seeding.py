"""The derived seeds are the numbers the code drew before `omni.seeding` existed (the
pinned checksums depend on them)."""

import torch

from omni import seeding
from omni.context import step_seeds, update_seed


def test_derived_seeds_keep_their_numbers():
    assert update_seed(3, 5) == 3 * 15_485_863 + 5
    assert seeding.derive_seed(2, 12345, seeding.EVAL_CHUNK) == 12345 + 2 * 1_000_000_007
    assert seeding.derive_seed(7, 1, seeding.MINIBATCHES) == 7 * 1_009 + 1
    expected = torch.randint(0, 2**31 - 1, (4,), generator=torch.Generator().manual_seed(1 * 1_000_003 + 2)).tolist()
    assert step_seeds(1, 2, 4) == expected
    order = torch.randperm(9, generator=seeding.seeded_generator(4, 1, seeding.EPOCH_ORDER))
    assert order.tolist() == torch.randperm(9, generator=torch.Generator().manual_seed(4 * 100_003 + 1)).tolist()
