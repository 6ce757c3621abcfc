"""Prompt files and the seeded, resumable prompt order."""

import pytest

from omni.data.prompts import items_for_step, load_prompts


def test_builtin_sets_are_disjoint():
    train, held_out = load_prompts("omni:colors_train"), load_prompts("omni:colors_eval")
    assert train and held_out and not set(train) & set(held_out)


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.train=.*nope.txt"):
        load_prompts(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))


def test_order_is_seeded_and_covers_each_epoch():
    prompts = [f"p{i}" for i in range(10)]
    epoch = items_for_step(prompts, 0, 5, seed=1) + items_for_step(prompts, 1, 5, seed=1)
    assert sorted(epoch) == sorted(prompts)
    assert items_for_step(prompts, 3, 4, seed=1) == items_for_step(prompts, 3, 4, seed=1)
    assert items_for_step(prompts, 0, 10, seed=1) != items_for_step(prompts, 0, 10, seed=2)


def test_jsonl_items_carry_their_metadata_and_line(tmp_path):
    import pickle

    path = tmp_path / "items.jsonl"
    path.write_text(
        '{"prompt": "a photo of a bench", "tag": "single_object", "include": [{"class": "bench", "count": 1}]}\n\n'
        '{"prompt": "a cat", "tag": "colors"}\n'
    )
    prompts = load_prompts(str(path))
    assert prompts == ["a photo of a bench", "a cat"] and prompts[1].origin == f"{path}, line 3"
    assert prompts[0].metadata == {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
    picked = items_for_step(prompts, 0, 2, seed=0)
    assert {p.metadata["tag"] for p in picked} == {"single_object", "colors"}  # the same objects, metadata kept
    copy = pickle.loads(pickle.dumps(prompts[0]))  # as a Ray worker group ships them
    assert copy == prompts[0] and copy.metadata == prompts[0].metadata and copy.origin == prompts[0].origin


@pytest.mark.parametrize(
    "line, reason", [("{not json", "not JSON"), ('{"text": "x"}', "non-empty string 'prompt'"), ('["a"]', "an object")]
)
def test_bad_jsonl_lines_are_named(tmp_path, line, reason):
    path = tmp_path / "items.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"data.train={path}: {path}, line 2: .*{reason}"):
        load_prompts(str(path))
    assert load_prompts(str(path), skip_bad_rows=True) == ["fine"]


def test_csv_rows_carry_their_columns_as_metadata(tmp_path):
    path = tmp_path / "drawbench.csv"  # DrawBench's layout, as a spreadsheet exports it (BOM, CRLF, quoted commas)
    path.write_bytes(
        '\ufeffPrompts,Category,\r\nA red car.,Colors,\r\n\r\n"A cup, then\r\na plate.",Positional,x\r\n'.encode()
    )
    prompts = load_prompts(str(path))
    assert prompts == ["A red car.", "A cup, then\na plate."]
    assert [p.metadata for p in prompts] == [
        {"category": "Colors"},
        {"category": "Positional"},
    ]  # the unnamed column is left out
    assert [p.origin for p in prompts] == [f"{path}, line 2", f"{path}, line 4"]
    caption = tmp_path / "pickapic.csv"
    caption.write_text("caption,best_image_uid\na castle at dawn,17\n")
    assert load_prompts(str(caption)) == ["a castle at dawn"] and load_prompts(str(caption))[0].metadata == {
        "best_image_uid": "17"
    }
    shipped = load_prompts("omni:drawbench_sample")
    assert all(p.metadata["category"] for p in shipped) and len({p.metadata["category"] for p in shipped}) > 3


@pytest.mark.parametrize(
    "rows, line, reason",
    [
        ("A red car.,Colors,extra\n", 3, "3 fields where the header has 2"),
        (",Colors\n", 3, "the prompt column 'Prompts' is empty"),
        ('"A red car.,Colors\nA cat.,Colors\n', 3, "1 fields where the header has 2"),  # an unclosed quote
    ],
)
def test_bad_csv_rows_are_named(tmp_path, rows, line, reason):
    path = tmp_path / "bench.csv"
    path.write_text("Prompts,Category\nA blue car.,Colors\n" + rows)
    with pytest.raises(ValueError, match=f"data.eval={path}: {path}, line {line}: {reason}"):
        load_prompts(str(path), "data.eval")
    assert load_prompts(str(path), skip_bad_rows=True)[0] == "A blue car."


def test_a_csv_without_a_prompt_column_is_named_at_validation(tmp_path):
    from omni.validation import ConfigError, validate
    from tests.conftest import compose_config

    path = tmp_path / "bench.csv"
    path.write_text("Text,Category\nA red car.,Colors\n")
    with pytest.raises(
        ConfigError,
        match=rf"data.train={path}: {path}, line 1: .*header naming its prompt column.*\['Text', 'Category'\]",
    ):
        validate(compose_config(["data=drawbench", f"data.train={path}"], tmp_path))
    with pytest.raises(ValueError, match="line 1"):
        load_prompts(str(path), skip_bad_rows=True)  # no row can be read without the header
