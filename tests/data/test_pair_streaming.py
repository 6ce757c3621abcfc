"""Streaming preference pairs: parquet shards (folder or glob) and JSONL read by row number,
bad rows named with their shard, the DataLoader (with real worker processes) giving the same
batches as the driver, images that fail to decode behind a good header, and the data
position (pairs consumed) continuing the in-memory order."""

import importlib.util
import json
import pickle

import numpy as np
import pytest
import torch

from omni.data.pair_loader import PairImages, TrainBatches, batch_positions, pair_loader, split_positions
from omni.data.pair_sources import JsonlSource, ParquetSource, load_preference_pairs, open_pair_source, scan
from omni.data.prompts import items_for_step
from omni.data.synthetic_pairs import write_synthetic_pairs
from tests.data.damage import scramble_png_pixels, truncate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
N = 40


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory):
    """The same 40 pairs as PNG files + JSONL and as 3 parquet shards of embedded bytes."""
    root = tmp_path_factory.mktemp("layouts")
    jsonl = write_synthetic_pairs(root / "files", N, resolution=16, seed=3)
    shards = write_synthetic_pairs(
        root / "shards", N, resolution=16, seed=3, layout="parquet", shard_size=16, row_group_size=5
    )
    return jsonl, shards


def _pixels(pairs):
    return [(p.prompt, np.asarray(p.chosen).tobytes(), np.asarray(p.rejected).tobytes()) for p in pairs]


def test_shards_folder_glob_and_jsonl_hold_the_same_pairs(both_layouts):
    jsonl, shards = both_layouts
    assert len(list(shards.glob("*.parquet"))) == 3
    source = open_pair_source(shards)
    assert isinstance(source, ParquetSource) and len(source) == N
    expected = _pixels(load_preference_pairs(jsonl)[0])
    assert _pixels(load_preference_pairs(shards)[0]) == expected
    assert _pixels(load_preference_pairs(f"{shards}/pairs-*.parquet")[0]) == expected
    # random access across shards and row groups gives the rows the sequential scan gives
    scanned = [row for _, row in source.scan_rows()]
    picked = [37, 2, 16, 15, 5, 37]
    assert source.rows(picked) == [scanned[i] for i in picked]
    assert source.where(17) == (shards / "pairs-00001.parquet", "row 2")
    lines = JsonlSource([jsonl])
    assert lines.rows([39, 0]) == [json.loads(line) for line in (jsonl.read_text().splitlines()[i] for i in (39, 0))]


def test_a_source_holds_no_rows(both_layouts):
    """What a DataLoader worker receives is row offsets, never images: its size does not
    grow with the images it reads."""
    jsonl, shards = both_layouts
    data_bytes = sum(p.stat().st_size for p in shards.glob("*.parquet"))
    for source in (open_pair_source(shards), open_pair_source(jsonl)):
        source.rows([0, 1, 2])  # opens the files, as a worker does
        assert len(pickle.dumps(source)) < 2_000 < data_bytes


def test_bad_row_in_a_shard_is_named_with_its_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = write_synthetic_pairs(tmp_path / "good", 4, resolution=8, layout="parquet", shard_size=4)
    table = pq.read_table(good / "pairs-00000.parquet")
    broken = table.set_column(
        1, "chosen", pa.array([table["chosen"][0].as_py(), b"not an image", *table["chosen"][2:].to_pylist()])
    )
    (tmp_path / "set").mkdir()
    pq.write_table(table, tmp_path / "set" / "a.parquet")
    pq.write_table(broken, tmp_path / "set" / "b.parquet")
    with pytest.raises(
        ValueError, match=r"data.pairs=.*b.parquet, row 2: cannot read image the bytes in column 'chosen'"
    ):
        scan(open_pair_source(tmp_path / "set"))
    found = scan(open_pair_source(tmp_path / "set"), skip_bad_rows=True)
    assert found.stats == {"rows": 8, "pairs": 7, "skipped_bad": 1, "skipped_ties": 0}
    assert found.good_rows.tolist() == [0, 1, 2, 3, 4, 6, 7]


def test_worker_processes_give_the_driver_batches(both_layouts):
    jsonl, shards = both_layouts
    source = open_pair_source(shards)
    rows = scan(source).good_rows
    train, _ = split_positions(len(rows), 0.25, seed=0)
    dataset = PairImages(source, rows, train, resolution=16, key="data.pairs", skip_bad_rows=False)
    batches = {}
    for workers in (0, 2):
        loader = iter(pair_loader(dataset, TrainBatches(20, 8, len(train), seed=1), workers))
        batches[workers] = [next(loader) for _ in range(4)]  # crosses into the second epoch
    for a, b in zip(batches[0], batches[2]):
        assert a.prompts == b.prompts and torch.equal(a.chosen, b.chosen) and torch.equal(a.rejected, b.rejected)
    # the images are the pairs' own: the chosen is the brighter one, in [0, 1]
    assert all(bool((d.chosen.mean((1, 2, 3)) > d.rejected.mean((1, 2, 3))).all()) for d in batches[0])


def test_data_position_continues_the_in_memory_order():
    n_train, batch, seed = 11, 4, 5
    for step in range(6):  # the in-memory rule, over several epochs
        assert batch_positions(step * batch, batch, n_train, seed) == items_for_step(
            list(range(n_train)), step, batch, seed
        )
    straight = [b for _, b in zip(range(5), TrainBatches(0, batch, n_train, seed))]
    resumed = [b for _, b in zip(range(3), TrainBatches(2 * batch, batch, n_train, seed))]
    assert resumed == straight[2:]
    assert batch_positions(3, 2, n_train, seed) == straight[0][3:] + straight[1][:1]  # any position, not only a step's


def test_image_that_fails_to_decode_is_named_or_dropped(tmp_path):
    """A PNG whose chunks are whole but whose pixels are not passes the scan and fails when decoded."""
    jsonl = write_synthetic_pairs(tmp_path, 6, resolution=16)
    image = tmp_path / "images" / "pair_00003_rejected.png"
    image.write_bytes(scramble_png_pixels(image.read_bytes()))
    source = open_pair_source(jsonl)
    rows = scan(source).good_rows
    assert len(rows) == 6
    strict = PairImages(source, rows, np.arange(6), 16, "data.pairs", skip_bad_rows=False)
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 4: cannot read image .*pair_00003_rejected.png"):
        next(iter(pair_loader(strict, [[0, 3, 5]], 0)))
    lenient = PairImages(source, rows, np.arange(6), 16, "data.pairs", skip_bad_rows=True)
    batch = next(iter(pair_loader(lenient, [[0, 3, 5]], 0)))
    assert len(batch) == 2 and batch.chosen.shape == (2, 3, 16, 16)
    assert len(batch.dropped) == 1 and "line 4" in batch.dropped[0]


@pytest.mark.parametrize("image_format", ["png", "jpeg"])
def test_truncated_image_bytes_in_a_shard_are_found_by_the_scan(tmp_path, image_format):
    """Bytes cut short behind a readable header are a bad row of the scan (which runs before
    any model loads), not a decoding error of the first step that reads them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = write_synthetic_pairs(
        tmp_path / "good", 4, resolution=32, layout="parquet", shard_size=4, image_format=image_format
    )
    table = pq.read_table(good / "pairs-00000.parquet")
    rejected = table["rejected"].to_pylist()
    rejected[2] = rejected[2][: len(rejected[2]) * 2 // 3]
    (tmp_path / "set").mkdir()
    pq.write_table(table.set_column(2, "rejected", pa.array(rejected)), tmp_path / "set" / "a.parquet")
    with pytest.raises(
        ValueError,
        match=r"data.pairs=.*a.parquet, row 3: cannot read image the bytes in column .rejected.: [Tt]runcated",
    ):
        scan(open_pair_source(tmp_path / "set"))
    assert scan(open_pair_source(tmp_path / "set"), skip_bad_rows=True).good_rows.tolist() == [0, 1, 3]


def test_truncated_arrow_file_of_a_saved_dataset_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        json.loads(line) for line in write_synthetic_pairs(tmp_path / "src", 6, resolution=8).read_text().splitlines()
    ]
    for row in rows:
        row["chosen"], row["rejected"] = ((tmp_path / "src" / row[k]).read_bytes() for k in ("chosen", "rejected"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    truncate(arrow, 0.6)
    with pytest.raises(ValueError, match=rf"{arrow}: .*truncated or not an Arrow file.*save_to_disk"):
        scan(open_pair_source(tmp_path / "saved"))
