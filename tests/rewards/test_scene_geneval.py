"""The scene reward (omni/rewards/scene_geneval.py) against the renderer's ground truth:
right on every held-out prompt's render, on at least 98% of spoilt renders, wrong on renders
of a corrupted prompt; GenEval's rules on hand-made detections; bad prompts refused at
validation with their file and line, before any model is built."""

import time

import numpy as np
import pytest
import torch

from omni import scenes
from omni.data.prompts import Prompt, load_prompts
from omni.rewards import WeightedReward
from omni.rewards.scene_geneval import SceneGeneval, SceneGenevalOptions, components, detect, evaluate
from omni.validation import ConfigError, validate
from tests import cli_process
from tests.conftest import compose_config

SIZE = 64  # the tiny models' resolution


def rendered(prompts, seed=0):
    return torch.stack([scenes.render(p.metadata, SIZE, seed + i) for i, p in enumerate(prompts)])


def test_right_on_every_held_out_render():
    prompts = load_prompts("omni:scenes_eval")
    _, details = SceneGeneval("scene_geneval", SceneGenevalOptions()).score_details(rendered(prompts), prompts)
    wrong = [str(p) for p, a in zip(prompts, details["accuracy"]) if a != 1]
    assert not wrong and bool((details["partial"] == 1).all())


def test_right_on_98_percent_of_spoilt_renders_in_milliseconds():
    """300 training-style renders, blurred (sigma up to 1 px), colour-shifted (8%) and noisy
    (std 0.03): at least 98% are scored correct, in well under 50 ms an image."""
    items = scenes.prompt_set(300, seed=123)
    prompts = [Prompt(item["prompt"], {k: v for k, v in item.items() if k != "prompt"}) for item in items]
    images = scenes.jitter(rendered(prompts, seed=1000), seed=5)
    assert (images - rendered(prompts, seed=1000)).abs().mean() > 0.02  # the spoiling is real
    start = time.perf_counter()
    _, details = SceneGeneval("scene_geneval", SceneGenevalOptions()).score_details(images, prompts)
    per_image = (time.perf_counter() - start) / len(prompts)
    assert details["accuracy"].mean() >= 0.98, [str(p) for p, a in zip(prompts, details["accuracy"]) if a != 1]
    assert per_image < 0.05


def test_exposure_and_colour_casts_are_balanced_out():
    """A darker or brighter image (short of clipping), or one channel's gain off by 40%, scores as the clean one:
    the background's median colour sets each channel's gain (without it, 0.7x exposure
    leaves almost nothing found)."""
    prompts = load_prompts("omni:scenes_eval")[::5]
    images = rendered(prompts)
    reward = SceneGeneval("scene_geneval", SceneGenevalOptions())
    for gain in ([0.7, 0.7, 0.7], [1.15, 1.15, 1.15], [0.6, 1.0, 1.0], [1.0, 1.0, 0.6]):
        cast = (images * torch.tensor(gain)[:, None, None]).clamp(0, 1)
        assert reward.score_details(cast, prompts)[1]["accuracy"].mean() >= 0.95, gain


def test_renders_of_a_corrupted_prompt_score_zero():
    """omni.scenes.corrupt (a scene DPO pair's rejected image) breaks what each prompt asks."""
    prompts, rng = load_prompts("omni:scenes_eval"), np.random.default_rng(0)
    images = torch.stack([scenes.render(scenes.corrupt(p.metadata, rng), SIZE, i) for i, p in enumerate(prompts)])
    _, details = SceneGeneval("scene_geneval", SceneGenevalOptions()).score_details(images, prompts)
    assert not details["accuracy"].any(), [str(p) for p, a in zip(prompts, details["accuracy"]) if a]
    attribution = torch.tensor([p.metadata["tag"] == "color_attr" for p in prompts])
    assert bool((details["partial"][attribution] == 0.5).all())  # both shapes there, both colours wrong


def test_noise_is_not_an_object():
    """Random pixels, smooth random fields and flat colours are scored as GenEval's
    detector would score an empty picture: (almost) never correct."""
    prompts = load_prompts("omni:scenes_eval")
    g = torch.Generator().manual_seed(0)
    fields = {
        "pixels": torch.rand(300, 3, SIZE, SIZE, generator=g),
        "smooth": torch.nn.functional.interpolate(torch.rand(300, 3, 8, 8, generator=g), size=SIZE, mode="bilinear"),
        "flat": torch.rand(300, 3, 1, 1, generator=g).expand(300, 3, SIZE, SIZE).contiguous(),
    }
    reward = SceneGeneval("scene_geneval", SceneGenevalOptions())
    for name, images in fields.items():
        assert reward.score_details(images, prompts)[1]["accuracy"].mean() <= 0.02, name


def flood_fill(mask):
    """Reference 8-connected labels, one breadth-first fill per component."""
    h, w = len(mask), len(mask[0])
    labels, n = [[0] * w for _ in range(h)], 0
    for i in range(h):
        for j in range(w):
            if mask[i][j] and not labels[i][j]:
                n += 1
                labels[i][j], queue = n, [(i, j)]
                while queue:
                    a, b = queue.pop()
                    for x in range(max(a - 1, 0), min(a + 2, h)):
                        for y in range(max(b - 1, 0), min(b + 2, w)):
                            if mask[x][y] and not labels[x][y]:
                                labels[x][y] = n
                                queue.append((x, y))
    return torch.tensor(labels)


def test_components_partition_as_a_flood_fill_does():
    masks = (
        torch.rand(4, 40, 40, generator=torch.Generator().manual_seed(0))
        > torch.tensor([0.3, 0.45, 0.55, 0.7])[:, None, None]
    )
    for mask, labels in zip(masks, components(masks)):
        reference = flood_fill(mask.tolist())
        assert torch.equal(labels > 0, mask)
        pairs = set(zip(labels[mask].tolist(), reference[mask].tolist()))  # one-to-one
        assert len(pairs) == len(set(labels[mask].tolist())) == int(reference.max()) > 1


def obj(name, color, box, area=100):
    return {"class": name, "color": color, "box": box, "area": area}


def test_genevals_rules_on_detections():
    left, right = (0, 0, 10, 10), (30, 0, 40, 10)
    position = {
        "tag": "position",
        "include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1, "position": ["left of", 0]}],
    }
    assert evaluate([obj("circle", "red", right), obj("square", "blue", left)], position) == (True, 3, 3)
    assert evaluate([obj("circle", "red", left), obj("square", "blue", right)], position) == (False, 2, 3)
    assert evaluate([obj("square", "blue", left)], position) == (False, 1, 3)  # no target: the relation fails too
    counting = {
        "tag": "counting",
        "include": [{"class": "cross", "count": 2}],
        "exclude": [{"class": "cross", "count": 3}],
    }
    crosses = [obj("cross", "red", (i * 20, 0, i * 20 + 10, 10)) for i in range(3)]
    assert evaluate(crosses[:2], counting) == (True, 2, 2)
    assert evaluate(crosses, counting) == (False, 1, 2) and evaluate(crosses[:1], counting) == (False, 1, 2)
    attribution = {
        "tag": "color_attr",
        "include": [{"class": "circle", "count": 1, "color": "red"}, {"class": "square", "count": 1, "color": "blue"}],
    }
    # the circle of the asked colour counts, even beside a bigger one of another colour
    scene = [
        obj("circle", "green", left, area=300),
        obj("circle", "red", right),
        obj("square", "blue", (60, 0, 70, 10)),
    ]
    assert evaluate(scene, attribution) == (True, 4, 4)
    assert evaluate([obj("circle", "blue", left), obj("square", "red", right)], attribution) == (False, 2, 4)


def test_both_scores_are_reported_and_dense_chooses_the_reward():
    prompts = load_prompts("omni:scenes_eval")[:12]
    images = rendered(prompts)
    images[0] = torch.tensor(scenes.BACKGROUND)[:, None, None]  # an empty image: nothing found
    for dense in (True, False):
        scores = WeightedReward({"scene_geneval": {"dense": dense}})(images, prompts, part=5)
        assert set(scores) == {"reward", "scene_geneval", "scene_geneval/accuracy", "scene_geneval/partial"}
        chosen = scores["scene_geneval/partial" if dense else "scene_geneval/accuracy"]
        assert (
            torch.equal(scores["reward"], chosen)
            and scores["reward"][0] == 0
            and bool((scores["reward"][1:] == 1).all())
        )
    assert detect(images[:1]) == [[]]


BAD_LINES = [  # (line, what the error names), one per kind of fault
    (
        '{"prompt": "a photo of a hexagon", "tag": "single_object", "include": [{"class": "hexagon", "count": 1}]}',
        "class 'hexagon' is not a scene shape",
    ),
    (
        '{"prompt": "a photo of a teal circle", "tag": "colors", "include": [{"class": "circle", "count": 1, '
        '"color": "teal"}]}',
        "color 'teal'",
    ),
    (
        '{"prompt": "a photo of seven circles", "tag": "counting", "include": [{"class": "circle", "count": 7}]}',
        "count 7 is not",
    ),
    (
        '{"prompt": "a circle near a square", "tag": "position", "include": [{"class": "circle", "count": 1}, '
        '{"class": "square", "count": 1, "position": ["near", 0]}]}',
        "relation 'near'",
    ),
    ('{"prompt": "a photo of a circle"}', "a 'tag' among"),
    ('{"prompt": "a photo of a circle", "tag": "single_object", "include": "circle"}', "non-empty 'include' list"),
]


@pytest.mark.parametrize("line, named", BAD_LINES, ids=["class", "color", "count", "relation", "no_tag", "bad_include"])
def test_a_prompt_outside_the_vocabulary_fails_validation_at_its_line(line, named, tmp_path, tiny_cache):
    good = '{"prompt": "a photo of a circle", "tag": "single_object", "include": [{"class": "circle", "count": 1}]}\n'
    path = tmp_path / "prompts.jsonl"
    path.write_text(good + "\n" + line + "\n")
    overrides = ["data=scenes", "reward=scene_geneval", f"model.cache_dir={tiny_cache}"]
    with pytest.raises(
        ConfigError,
        match=f"data.eval={path}: {path}, line 3: reward.components.scene_geneval needs scene metadata .*{named}",
    ):
        validate(compose_config(overrides + [f"data.eval={path}"]))
    validate(compose_config(overrides))


def test_prompts_without_metadata_stop_the_real_entry_before_a_model_is_built(tmp_path):
    """A plain-text prompt file has no metadata: recipes/train.py names its first line and
    exits before the tiny model is built into the (empty) cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    run = cli_process.run(
        ["recipes/train.py", "reward=scene_geneval", "data=colors", f"model.cache_dir={cache}",
         f"output_dir={tmp_path / 'out'}"],
        timeout=300,
    )  # fmt: skip
    assert (
        run.returncode != 0
        and "colors_train.txt, line 1: reward.components.scene_geneval needs scene metadata" in run.stderr + run.stdout
    )
    assert not any(cache.iterdir())
