"""Preference pairs: the synthetic writer, JSONL / parquet / saved-dataset reading, the
Pick-a-Pic layout, bad rows (raised or skipped and counted) and images -> tensors."""

import importlib.util
import io
import json
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from omni.data.pair_sources import load_preference_pairs
from omni.data.preferences import PreferencePair, images_to_tensor
from omni.data.prompts import load_prompts
from omni.data.synthetic_pairs import write_scene_pairs, write_synthetic_pairs

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _png(path, color, size=(8, 8)):
    Image.new("RGB", size, color).save(path)
    return path


def _png_bytes(color):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _mean(image):
    return float(np.asarray(image, dtype=np.float32).mean())


@pytest.fixture
def images(tmp_path):
    return {name: _png(tmp_path / f"{name}.png", color).name for name, color in [("red", RED), ("green", GREEN)]}


def test_synthetic_round_trip(tmp_path):
    jsonl = write_synthetic_pairs(tmp_path / "set", n_pairs=6, resolution=16, seed=0)
    pairs, stats = load_preference_pairs(jsonl)
    assert stats == {"rows": 6, "pairs": 6, "skipped_bad": 0, "skipped_ties": 0}
    assert all(isinstance(p, PreferencePair) and p.chosen.size == (16, 16) for p in pairs)
    assert all(_mean(p.chosen) > _mean(p.rejected) for p in pairs)  # chosen is always the brighter
    assert {p.prompt for p in pairs} <= set(load_prompts("omni:colors_train"))


def test_scene_pairs_are_right_against_wrong_for_the_scene_reward(tmp_path):
    """Each chosen image does what its training prompt asks and the rejected one does not, as
    scene_geneval reads them back from the written files; the same seed writes the same set."""
    from omni.rewards.scene_geneval import SceneGeneval, SceneGenevalOptions

    jsonl = write_scene_pairs(tmp_path / "set", n_pairs=24, resolution=64, seed=3)
    pairs, stats = load_preference_pairs(jsonl)
    assert stats["pairs"] == 24
    by_text = {str(p): p for p in load_prompts("omni:scenes_train")}
    prompts = [by_text[p.prompt] for p in pairs]
    assert len({p.metadata["tag"] for p in prompts}) == 6  # every category
    reward = SceneGeneval("scene_geneval", SceneGenevalOptions())
    for side, expected in (("chosen", 1.0), ("rejected", 0.0)):
        images = images_to_tensor([getattr(p, side) for p in pairs], 64)
        accuracy = reward.score_details(images, prompts)[1]["accuracy"]
        assert accuracy.tolist() == [expected] * 24, side
    again = write_scene_pairs(tmp_path / "again", n_pairs=24, resolution=64, seed=3)
    assert again.read_text() == jsonl.read_text()
    assert (again.parent / "images/pair_00005_rejected.png").read_bytes() == (
        jsonl.parent / "images/pair_00005_rejected.png"
    ).read_bytes()


@pytest.mark.parametrize("layout", ["jsonl", "parquet"])
def test_synthetic_jpeg_images_as_pickapic_stores_them(tmp_path, layout):
    """JPEG (lossy): the chosen image stays the brighter, by about the 2 * 0.1 gap written."""
    path = write_synthetic_pairs(tmp_path / "set", n_pairs=3, resolution=24, seed=0, layout=layout, image_format="jpeg")
    pairs, _ = load_preference_pairs(path)
    if layout == "jsonl":
        first = (path.parent / json.loads(path.read_text().splitlines()[0])["chosen"]).read_bytes()
    else:
        import pyarrow.parquet as pq

        first = pq.read_table(next(path.glob("*.parquet")))["chosen"][0].as_py()
    assert first[:3] == b"\xff\xd8\xff"  # a JPEG's start of image
    assert all(p.chosen.size == (24, 24) for p in pairs)
    assert all(abs(_mean(p.chosen) - _mean(p.rejected) - 0.2 * 255) < 2 for p in pairs)
    with pytest.raises(ValueError, match="image_format must be one of png, jpeg, got 'gif'"):
        write_synthetic_pairs(tmp_path / "gif", 1, image_format="gif")


def test_synthetic_is_deterministic_for_a_seed(tmp_path):
    first = write_synthetic_pairs(tmp_path / "a", 3, 16, seed=7)
    again = write_synthetic_pairs(tmp_path / "b", 3, 16, seed=7)
    other = write_synthetic_pairs(tmp_path / "c", 3, 16, seed=8)
    for name in ["pairs.jsonl", "images/pair_00002_chosen.png", "images/pair_00001_rejected.png"]:
        assert (first.parent / name).read_bytes() == (again.parent / name).read_bytes()
    name = "images/pair_00000_chosen.png"
    assert (first.parent / name).read_bytes() != (other.parent / name).read_bytes()


def test_absolute_image_paths(tmp_path, images):
    row = {"prompt": "a", "chosen": str(tmp_path / images["red"]), "rejected": images["green"]}
    jsonl = _write_jsonl(tmp_path / "sub.jsonl", [row])
    (pair,), _ = load_preference_pairs(jsonl)
    assert pair.chosen.getpixel((0, 0)) == RED and pair.rejected.getpixel((0, 0)) == GREEN


def test_pickapic_layout_with_a_tie(tmp_path, images):
    rows = [
        {"caption": "zero wins", "jpg_0": images["red"], "jpg_1": images["green"], "label_0": 1},
        {"caption": "one wins", "jpg_0": images["red"], "jpg_1": images["green"], "label_0": 0.0},
        {"caption": "tie", "jpg_0": images["red"], "jpg_1": images["green"], "label_0": 0.5},
    ]
    pairs, stats = load_preference_pairs(_write_jsonl(tmp_path / "pap.jsonl", rows))
    assert stats == {"rows": 3, "pairs": 2, "skipped_bad": 0, "skipped_ties": 1}
    assert [p.prompt for p in pairs] == ["zero wins", "one wins"]
    assert pairs[0].chosen.getpixel((0, 0)) == RED and pairs[1].chosen.getpixel((0, 0)) == GREEN


def _bad_rows(tmp_path, images):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    good = {"prompt": "fine", "chosen": images["red"], "rejected": images["green"]}
    return {
        "missing image": ({**good, "chosen": "nope.png"}, "image file not found.*nope.png"),
        "unreadable image": ({**good, "rejected": "broken.png"}, "cannot read image.*broken.png"),
        "bad label": ({"caption": "c", "jpg_0": images["red"], "jpg_1": images["green"], "label_0": 2}, "label_0 is 2"),
        "empty prompt": ({**good, "prompt": "  "}, "empty prompt"),
        "missing column": ({"prompt": "p", "chosen": images["red"]}, "missing column.*'rejected'"),
        "not json": ("{oops", "not valid JSON"),
    }


@pytest.mark.parametrize(
    "case", ["missing image", "unreadable image", "bad label", "empty prompt", "missing column", "not json"]
)
def test_bad_row_names_file_and_line(tmp_path, images, case):
    good = {"prompt": "fine", "chosen": images["red"], "rejected": images["green"]}
    bad, reason = _bad_rows(tmp_path, images)[case]
    jsonl = _write_jsonl(tmp_path / "pairs.jsonl", [good, good, bad])
    with pytest.raises(ValueError, match=f"pairs.jsonl, line 3: {reason}"):
        load_preference_pairs(jsonl)


def test_skip_bad_rows_counts_them(tmp_path, images, caplog):
    good = {"prompt": "fine", "chosen": images["red"], "rejected": images["green"]}
    tie = {"caption": "t", "jpg_0": images["red"], "jpg_1": images["green"], "label_0": 0.5}
    bad = [row for row, _ in _bad_rows(tmp_path, images).values()]
    jsonl = _write_jsonl(tmp_path / "pairs.jsonl", [good, *bad, "", tie, good])  # the blank line is not a row
    pairs, stats = load_preference_pairs(jsonl, skip_bad_rows=True)
    assert len(pairs) == 2
    assert stats == {"rows": 9, "pairs": 2, "skipped_bad": 6, "skipped_ties": 1}
    assert "skipped 6 bad row(s) of 9" in caplog.text


def test_missing_empty_and_unsupported_files(tmp_path, images):
    with pytest.raises(FileNotFoundError, match="data.pairs=.*nope.jsonl"):
        load_preference_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no preference pairs"):
        load_preference_pairs(_write_jsonl(tmp_path / "empty.jsonl", [""]))
    tie = {"caption": "t", "jpg_0": images["red"], "jpg_1": images["green"], "label_0": 0.5}
    with pytest.raises(ValueError, match="no preference pairs.*'skipped_ties': 1"):
        load_preference_pairs(_write_jsonl(tmp_path / "ties.jsonl", [tie]))
    (tmp_path / "pairs.csv").write_text("prompt,chosen,rejected\n")
    with pytest.raises(ValueError, match="unsupported preference file"):
        load_preference_pairs(tmp_path / "pairs.csv", key="data.train_pairs")
    if HAS_DATASETS:
        (tmp_path / "not_a_dataset").mkdir()
        with pytest.raises(ValueError, match="not_a_dataset is a directory but not a dataset saved"):
            load_preference_pairs(tmp_path / "not_a_dataset")


def test_missing_libraries_are_named(tmp_path, monkeypatch):
    (tmp_path / "pairs.parquet").write_bytes(b"")
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_preference_pairs(tmp_path / "pairs.parquet")
    with pytest.raises(ImportError, match="pip install datasets"):
        load_preference_pairs(tmp_path / "saved")


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed: parquet reading is untested")
def test_parquet_paths_bytes_and_structs(tmp_path, images):
    import pyarrow as pa
    import pyarrow.parquet as pq

    standard = pa.table({"prompt": ["p"], "chosen": [images["red"]], "rejected": [images["green"]]})
    pq.write_table(standard, tmp_path / "standard.parquet")
    (pair,), _ = load_preference_pairs(tmp_path / "standard.parquet")
    assert pair.chosen.getpixel((0, 0)) == RED

    pickapic = pa.table(
        {
            "caption": ["raw bytes", "structs", "bad"],
            "jpg_0": [_png_bytes(RED), _png_bytes(RED), _png_bytes(RED)],
            "jpg_1": [{"bytes": _png_bytes(BLUE), "path": None}] * 3,
            "label_0": [1.0, 0.0, 0.25],
        }
    )
    pq.write_table(pickapic, tmp_path / "pap.parquet")
    with pytest.raises(ValueError, match="pap.parquet, row 3: label_0 is 0.25"):
        load_preference_pairs(tmp_path / "pap.parquet")
    pairs, stats = load_preference_pairs(tmp_path / "pap.parquet", skip_bad_rows=True)
    assert stats["skipped_bad"] == 1 and [p.chosen.getpixel((0, 0)) for p in pairs] == [RED, BLUE]


@pytest.mark.skipif(not HAS_DATASETS, reason="datasets is not installed: save_to_disk reading is untested")
def test_saved_dataset_with_image_features(tmp_path):
    import datasets

    rows = {
        "caption": ["c", "bad"],
        "jpg_0": [Image.new("RGB", (8, 8), RED)] * 2,
        "jpg_1": [Image.new("RGB", (8, 8), GREEN)] * 2,
        "label_0": [0.0, 0.5],
    }
    features = datasets.Features(
        {
            "caption": datasets.Value("string"),
            "jpg_0": datasets.Image(),
            "jpg_1": datasets.Image(),
            "label_0": datasets.Value("float32"),
        }
    )
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    (pair,), stats = load_preference_pairs(tmp_path / "saved")
    assert stats["skipped_ties"] == 1 and pair.chosen.getpixel((0, 0)) == GREEN


def test_images_to_tensor_resizes_and_center_crops():
    wide = Image.new("RGB", (80, 40), RED)
    wide.paste(Image.new("RGB", (40, 40), GREEN), (20, 0))  # green in the middle half
    batch = images_to_tensor([wide, Image.new("RGB", (20, 20), BLUE)], resolution=20)
    assert batch.shape == (2, 3, 20, 20) and batch.dtype == torch.float32
    assert batch.min() >= 0 and batch.max() <= 1
    assert torch.allclose(batch[0, :, 10, 10], torch.tensor([0.0, 1.0, 0.0]), atol=0.02)
    assert torch.equal(batch[1], torch.tensor([0.0, 0.0, 1.0]).reshape(3, 1, 1).expand(3, 20, 20))


def test_non_utf8_pair_line_is_named_or_skipped(tmp_path, images):
    good = json.dumps({"prompt": "fine", "chosen": images["red"], "rejected": images["green"]}).encode()
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_bytes(good + b"\n" + b'{"prompt": "\xe9t\xe9"}\n' + good + b"\n")
    with pytest.raises(ValueError, match="pairs.jsonl, line 2: not UTF-8 text"):
        load_preference_pairs(jsonl)
    pairs, stats = load_preference_pairs(jsonl, skip_bad_rows=True)
    assert len(pairs) == 2 and stats["skipped_bad"] == 1
