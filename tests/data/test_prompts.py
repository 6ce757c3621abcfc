"""Prompt files and the seeded, resumable prompt order."""

import pytest

from omni.data.prompts import load_prompts, items_for_step


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
