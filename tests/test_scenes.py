"""The scene renderer and its prompts (omni/scenes.py): GenEval's metadata and templates,
seeded drawing, layouts that satisfy the metadata, the shipped sets, refused metadata."""

import json
from collections import Counter
from importlib import resources

import pytest
import torch

from omni import scenes
from omni.data.prompts import load_prompts


def test_prompts_follow_genevals_templates_and_metadata():
    rng = __import__("numpy").random.default_rng(0)
    items = {tag: scenes.sample_metadata(rng, tag) for tag in scenes.TAGS}
    counting = items["counting"]
    n = counting["include"][0]["count"]
    assert counting["exclude"] == [{"class": counting["include"][0]["class"], "count": n + 1}]
    assert counting["prompt"].startswith(f"a photo of {scenes.COUNT_WORDS[n]} ")
    target, subject = items["position"]["include"]
    assert (
        items["position"]["prompt"] == f"a photo of a {subject['class']} {subject['position'][0]} a {target['class']}"
    )
    first, second = items["color_attr"]["include"]
    assert (
        items["color_attr"]["prompt"]
        == f"a photo of a {first['color']} {first['class']} and a {second['color']} {second['class']}"
    )
    assert (
        scenes.prompt_text({"tag": "counting", "include": [{"class": "cross", "count": 3}]})
        == "a photo of three crosses"
    )
    assert all(scenes.metadata_problem(item) is None for item in items.values())


def test_scenes_are_a_function_of_their_seed():
    item = scenes.prompt_set(6, seed=3)[4]
    assert torch.equal(scenes.render(item, 64, seed=5), scenes.render(item, 64, seed=5))
    assert not torch.equal(scenes.render(item, 64, seed=5), scenes.render(item, 64, seed=6))
    assert scenes.prompt_set(30, seed=3) == scenes.prompt_set(30, seed=3) != scenes.prompt_set(30, seed=4)
    image = scenes.render(item, 32, seed=0)
    assert image.shape == (3, 32, 32) and image.min() >= 0 and image.max() <= 1


@pytest.mark.parametrize("size", [32, 64])
def test_layouts_satisfy_their_metadata(size):
    """Every object the metadata asks for, in its colour, apart from the others and inside
    the image; every position holds by GenEval's own rule on the boxes."""
    for seed, item in enumerate(scenes.prompt_set(120, seed=size)):
        scene = scenes.layout(item, size, seed)
        drawn = Counter(shape for shape, _, _ in scene)
        assert drawn == Counter({e["class"]: e["count"] for e in item["include"]}), item
        boxes = [(x - s / 2, y - s / 2, x + s / 2, y + s / 2) for _, _, (x, y, s) in scene]
        assert all(0 <= v <= size for box in boxes for v in box)
        for i, a in enumerate(boxes):
            for b in boxes[:i]:  # no two boxes overlap
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
        for entry in item["include"]:
            mine = [box for (shape, color, _), box in zip(scene, boxes) if shape == entry["class"]]
            assert all(
                color == entry["color"] for shape, color, _ in scene if shape == entry["class"] and "color" in entry
            )
            if "position" in entry:
                relation, target = entry["position"]
                (theirs,) = [
                    box for (shape, _, _), box in zip(scene, boxes) if shape == item["include"][target]["class"]
                ]
                assert relation in scenes.relative_position(mine[0], theirs), (item, mine, theirs)


def test_relative_position_is_genevals():
    assert scenes.relative_position((0, 0, 10, 10), (20, 0, 30, 10)) == {"left of"}
    assert scenes.relative_position((20, 0, 30, 10), (0, 0, 10, 10)) == {"right of"}
    assert scenes.relative_position((0, 0, 10, 10), (0, 20, 10, 30)) == {"above"}
    assert scenes.relative_position((0, 0, 10, 10), (15, 15, 25, 25)) == {"left of", "above"}  # diagonal: both
    assert scenes.relative_position((0, 0, 10, 10), (1, 1, 11, 11)) == set()  # within the tenth of the sides


def read_asset(name):
    return (resources.files("omni") / "assets" / name).read_text()


def test_the_shipped_sets_are_the_generators():
    """The shipped prompt files are what scripts/make_scene_prompts.py writes, so they stay
    reproducible; the held-out set has 50 prompts a category, and no colour-attribution
    prompt of it is trained on."""
    assert read_asset("scenes_eval.jsonl") == scenes.to_jsonl(scenes.held_out_prompts())
    assert read_asset("scenes_train.jsonl") == scenes.to_jsonl(scenes.training_prompts(1200, 0))
    held_out, train = load_prompts("omni:scenes_eval"), load_prompts("omni:scenes_train")
    assert Counter(p.metadata["tag"] for p in held_out) == {tag: 50 for tag in scenes.TAGS}
    held_attr = {p for p in held_out if p.metadata["tag"] == "color_attr"}
    assert len(held_attr) == 50 and not held_attr & {p for p in train if p.metadata["tag"] == "color_attr"}
    assert all(scenes.metadata_problem(p.metadata) is None for p in held_out + train)


def test_every_prompt_word_is_in_the_scene_vocabulary():
    texts = [p for p in load_prompts("omni:scenes_eval") + load_prompts("omni:scenes_train")]
    assert {w for text in texts for w in text.split()} <= set(scenes.WORDS)
    assert max(len(text.split()) for text in texts) <= 10  # with start and end, within 16 tokens


def test_genevals_own_metadata_is_read_and_its_vocabulary_refused():
    """GenEval's sample lines parse as scene metadata; only their classes (umbrella, ...)
    fall outside the renderer's vocabulary."""
    for line in read_asset("geneval_sample.jsonl").splitlines():
        item = json.loads(line)
        problem = scenes.metadata_problem(item)
        assert problem and "is not a scene shape" in problem, (item, problem)
        shapes = iter(scenes.SHAPES)
        renamed = {
            name: next(shapes) for name in dict.fromkeys(e["class"] for e in item["include"] + item.get("exclude", []))
        }
        for entry in item["include"] + item.get("exclude", []):
            entry["class"] = renamed[entry["class"]]
        assert scenes.metadata_problem(item) is None, item
        scenes.render(item, 64, 0)


GOOD = {
    "tag": "position",
    "include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": ["left of", 0]}],
}


@pytest.mark.parametrize(
    "change, named",
    [
        ({"tag": "spatial"}, "a 'tag' among"),
        ({"include": []}, "non-empty 'include'"),
        ({"include": [{"class": "circle"}]}, "needs 'class' and 'count'"),
        ({"include": [{"class": "circle", "count": 1, "size": "big"}]}, "not \\['size'\\]"),
        ({"include": [{"class": "hexagon", "count": 1}]}, "class 'hexagon' is not a scene shape"),
        ({"include": [{"class": "circle", "count": 5}]}, "count 5 is not a whole number from 1 to 4"),
        ({"include": [{"class": "circle", "count": "2"}]}, "count '2'"),
        ({"include": [{"class": "circle", "count": 1, "color": "teal"}]}, "color 'teal' is not a scene colour"),
        (
            {"include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": ["near", 0]}]},
            "relation 'near'",
        ),
        (
            {"include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": ["above", 1]}]},
            "not an earlier entry",
        ),
        (
            {"include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": "above"}]},
            "not \\[relation, index",
        ),
        (
            {"include": [{"class": "circle", "count": 2}, {"class": "square", "count": 1, "position": ["above", 0]}]},
            "single objects",
        ),
        ({"include": [{"class": "circle", "count": 3}, {"class": "square", "count": 2}]}, "at most 4 objects"),
        ({"include": [{"class": "circle", "count": 1}, {"class": "circle", "count": 1}]}, "each class once"),
        ({"exclude": [{"class": "circle", "count": 1}]}, "an exclude that the include allows"),
        ({"exclude": {"class": "circle"}}, "'exclude' as a list"),
    ],
)
def test_unrenderable_metadata_is_named(change, named):
    assert scenes.metadata_problem(GOOD) is None
    problem = scenes.metadata_problem({**GOOD, **change})
    assert problem is not None and __import__("re").search(named, problem), problem
    with pytest.raises(ValueError, match="cannot draw"):
        scenes.render({**GOOD, **change}, 64, 0)
