"""Edit sets: JSONL with image files, parquet shards and a `datasets` directory with embedded
bytes give the same edits; every bad row is named with its file and line (or row) when the
set loads; a prompt file stays a prompt file."""

import json
import logging

import pytest
from PIL import Image

from omni.data.edits import is_edit_set, load_edits, open_sources
from omni.data.prompt_sets import load_prompt_set
from omni.recolor import recolor_edit, to_png
from tests.data.damage import truncate

N = 6


@pytest.fixture()
def jsonl_set(tmp_path):
    """N recolour edits as PNG files and a JSONL naming them relative to its folder."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows = []
    (tmp_path / "img").mkdir()
    for i in range(N):
        instruction, source, target = recolor_edit(rng, 32, seed=i)
        to_png(source, tmp_path / "img" / f"{i}-s.png")
        to_png(target, tmp_path / "img" / f"{i}-t.png")
        rows.append({"instruction": instruction, "image": f"img/{i}-s.png", "target": f"img/{i}-t.png", "id": i})
    path = tmp_path / "edits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def open_target(edit) -> Image.Image:
    with Image.open(edit.metadata["target"]) as image:
        return image.convert("RGB")


def pixels(image: Image.Image) -> bytes:
    return image.convert("RGB").tobytes()


def test_a_jsonl_edit_set_gives_prompts_with_their_sources_and_targets(jsonl_set):
    path, rows = jsonl_set
    edits = load_prompt_set(str(path))
    assert [str(e) for e in edits] == [r["instruction"] for r in rows]
    assert edits[2].origin == f"{path}, line 3" and edits[2].metadata["id"] == 2
    with Image.open(path.parent / "img" / "2-s.png") as source:
        assert pixels(open_sources(edits[2])[0]) == pixels(source)
    with Image.open(path.parent / "img" / "2-t.png") as target:
        assert pixels(open_target(edits[2])) == pixels(target)


def test_parquet_and_a_datasets_directory_of_bytes_give_the_same_edits(jsonl_set, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    path, rows = jsonl_set
    table = {
        "prompt": [r["instruction"] for r in rows],
        "images": [[(path.parent / r["image"]).read_bytes()] for r in rows],
        "target": [{"bytes": (path.parent / r["target"]).read_bytes(), "path": None} for r in rows],
    }
    pq.write_table(pa.table(table), tmp_path / "edits.parquet")
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "saved"))
    store = tmp_path / "store"
    expected = load_edits(str(path))
    for spec in (tmp_path / "edits.parquet", tmp_path / "saved"):
        edits = load_edits(str(spec), store=store)
        assert [str(e) for e in edits] == [str(e) for e in expected]
        for ours, theirs in zip(edits, expected):
            assert pixels(open_sources(ours)[0]) == pixels(open_sources(theirs)[0])
            assert pixels(open_target(ours)) == pixels(open_target(theirs))
    assert len(list(store.iterdir())) == 2 * N  # one file per distinct image, shared by both


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"image": "img/0-s.png"}, "no instruction"),
        ({"prompt": "make it red"}, "no source image"),
        ({"prompt": "make it red", "image": "img/missing.png"}, "image file not found in column 'image'"),
        ({"prompt": "make it red", "images": []}, "non-empty list"),
        ({"prompt": "make it red", "image": 3}, "holds a int"),
    ],
)
def test_a_bad_row_is_named_with_its_file_and_line(jsonl_set, row, reason):
    path, _ = jsonl_set
    with path.open("a") as stream:
        stream.write(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"data.train={path}: {path}, line {N + 1}: .*{reason}"):
        load_prompt_set(str(path))


def test_a_truncated_source_is_refused_or_skipped_and_logged(jsonl_set, caplog):
    path, _ = jsonl_set
    truncate(path.parent / "img" / "4-s.png")
    with pytest.raises(ValueError, match=r"line 5: cannot read image .*4-s.png"):
        load_prompt_set(str(path))
    with caplog.at_level(logging.WARNING):
        edits = load_prompt_set(str(path), skip_bad_rows=True)
    assert len(edits) == N - 1 and "line 5" in caplog.text
    assert [e.origin for e in edits[3:5]] == [f"{path}, line 4", f"{path}, line 6"]  # the bad row is not read again


def test_an_edit_set_is_read_row_by_row_as_it_is_used(jsonl_set):
    """Like preference pairs, the set keeps its good rows' numbers only: an edit is read from
    its line when asked for (the same edit every time), and the set pickles small."""
    import pickle

    path, rows = jsonl_set
    edits = load_edits(str(path))
    assert not hasattr(edits, "__dict__") or all(not isinstance(v, list) for v in vars(edits).values())
    assert edits.rows.tolist() == list(range(N)) and len(pickle.dumps(edits)) < 2000
    again = pickle.loads(pickle.dumps(edits))
    assert [(str(e), e.images, e.origin) for e in again] == [(str(e), e.images, e.origin) for e in edits]
    assert str(edits[-1]) == rows[-1]["instruction"] and [str(e) for e in edits[1:3]] == [
        r["instruction"] for r in rows[1:3]
    ]


def test_prompt_files_stay_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("a red cat\n")
    metadata_only = tmp_path / "p.jsonl"
    metadata_only.write_text(json.dumps({"prompt": "a red cat", "tag": "x"}) + "\n")
    assert not is_edit_set(text) and not is_edit_set(metadata_only)
    assert load_prompt_set(str(metadata_only))[0].images == ()
    with pytest.raises(FileNotFoundError, match="edit set not found"):
        load_prompt_set(str(tmp_path / "nowhere.parquet"))


def test_the_shipped_recolor_sets_load_with_a_target_for_every_edit():
    for name, count in (("recolor_train", 96), ("recolor_eval", 32)):
        edits = load_prompt_set(f"omni:{name}")
        assert len(edits) == count and all(len(e.images) == 1 and "target" in e.metadata for e in edits)
    source, target = open_sources(edits[0])[0], open_target(edits[0])
    assert source.size == target.size == (64, 64) and pixels(source) != pixels(target)


def test_edit_pairs_carry_their_sources_and_must_match_the_model(tmp_path):
    """Offline DPO on edits: a pair row's `image` makes its prompt an edit prompt; scanning for
    an edit model refuses a pair without a source, and for a text model one with a source,
    naming the row."""
    from omni.data.pair_sources import load_preference_pairs, open_pair_source, scan
    from omni.recolor import write_recolor_pairs

    pairs_file = write_recolor_pairs(tmp_path, "pairs", 4, seed=3)
    pairs, _ = load_preference_pairs(pairs_file)
    assert len(pairs) == 4 and all(len(p.prompt.images) == 1 for p in pairs)
    assert pixels(open_sources(pairs[0].prompt)[0]) == pixels(pairs[0].rejected)  # the unedited source
    source = open_pair_source(pairs_file)
    source.edit = True
    assert scan(source).stats["pairs"] == 4
    source.edit = False
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 1: the pair names source images but the model makes"):
        scan(source)
    text_pairs = tmp_path / "text.jsonl"
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    text_pairs.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "image"}) + "\n" for r in rows))
    source = open_pair_source(text_pairs)
    source.edit = True
    with pytest.raises(ValueError, match=r"text.jsonl, line 1: the model edits images: a pair needs its source"):
        scan(source)
