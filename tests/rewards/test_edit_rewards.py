"""The edit rewards on the recolour edits: the target scores 1 on both, the untouched source
keeps everything but misses the edit, paint outside the shape costs consistency only, and a
result of another size is compared at its own size."""

import pytest
import torch
import torch.nn.functional as F

from omni.data.prompt_sets import load_prompt_set
from omni.data.prompts import Prompt
from omni.rewards import REWARDS
from omni.rewards.edit_regions import changed_region, references


def reward(name, **options):
    cls = REWARDS.get(name)
    return cls(name, cls.Options(**options))


@pytest.fixture(scope="module")
def edits():
    return load_prompt_set("omni:recolor_eval")[:8]


def test_the_target_scores_one_and_the_source_misses_only_the_edit(edits):
    target, consistency = reward("edit_target"), reward("edit_consistency")
    sources = torch.stack([references(e, (64, 64))[0] for e in edits])
    targets = torch.stack([references(e, (64, 64))[1] for e in edits])
    assert torch.allclose(target.score(targets, edits), torch.ones(len(edits)))
    # the target's anti-aliased edge, under the threshold, differs from the source a little
    assert (consistency.score(targets, edits) > 0.995).all()
    assert torch.allclose(consistency.score(sources, edits), torch.ones(len(edits)))
    missed = target.score(sources, edits)
    assert (missed < 0.85).all() and missed.mean() < 0.75


def test_paint_outside_the_changed_region_costs_consistency_not_the_target(edits):
    target, consistency = reward("edit_target"), reward("edit_consistency")
    edit = edits[0]
    source, goal = references(edit, (64, 64))
    changed = changed_region(edit, source, goal, 0.1)
    painted = goal.clone()
    painted[:, ~changed] = 1.0  # everything else white
    assert target.score(painted[None], [edit])[0] == pytest.approx(1.0)
    assert consistency.score(painted[None], [edit])[0] < 0.7


def test_a_result_of_another_size_is_scored_against_resized_references(edits):
    target = reward("edit_target")
    _, goal = references(edits[0], (64, 64))
    larger = F.interpolate(goal[None], size=(96, 96), mode="bilinear", align_corners=False)
    assert target.score(larger, [edits[0]])[0] > 0.9


def test_prompts_without_what_the_rewards_need_are_named():
    plain = Prompt("a red cat")
    no_target = Prompt("make it red", images=["s.png"])
    assert "source image" in REWARDS.get("edit_consistency").prompt_problem(None, plain)
    assert REWARDS.get("edit_consistency").prompt_problem(None, no_target) is None
    assert "target image" in REWARDS.get("edit_target").prompt_problem(None, no_target)
