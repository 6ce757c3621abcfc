"""Group advantages and the rewards' aggregation (weighted sum, GDPO) on hand-made tensors."""

import math

import pytest
import torch

from omni.algorithms.advantages import (
    aggregated_advantages,
    batch_normalised,
    clip_advantages,
    gdpo_advantages,
    group_advantages,
    masked_group_advantages,
)


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0])
    adv = group_advantages(rewards, group_size=2, eps=1e-4)
    std = math.sqrt(2) + 1e-4  # unbiased std of (1, 3)
    assert torch.allclose(adv[:2], torch.tensor([-1 / std, 1 / std]))
    assert torch.allclose(adv[2:], torch.zeros(2))  # a tie gives no signal


def test_global_std():
    rewards = torch.tensor([1.0, 3.0, 5.0, 7.0])
    adv = group_advantages(rewards, group_size=2, norm="global", eps=0.0)
    # batch std of (1, 3, 5, 7): sqrt(((9 + 1 + 1 + 9) / 3)) = sqrt(20 / 3)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / math.sqrt(20 / 3))


def test_no_std_division_as_in_dr_grpo():
    rewards = torch.tensor([1.0, 3.0, 10.0, 16.0])
    adv = group_advantages(rewards, group_size=2, norm="none")
    # r - group mean only: group means 2 and 13
    assert torch.equal(adv, torch.tensor([-1.0, 1.0, -3.0, 3.0]))


@pytest.mark.parametrize("norm", ["group", "global", "none"])
def test_masked_advantages_leave_out_invalid_rewards(norm):
    """A non-finite reward gets advantage 0 and its group is normalised over the others."""
    rewards = torch.tensor([1.0, 3.0, 5.0, float("nan"), 2.0, 8.0])
    valid = torch.isfinite(rewards)
    adv = masked_group_advantages(rewards, valid, group_size=3, norm=norm, eps=0.0)
    # group 1: (1, 3, 5), mean 3, std 2; group 2: (2, 8), mean 5, std sqrt(18); batch std of the 5
    batch_std = math.sqrt(sum((r - 3.8) ** 2 for r in (1, 3, 5, 2, 8)) / 4)
    scale = {"group": (2.0, math.sqrt(18)), "global": (batch_std, batch_std), "none": (1.0, 1.0)}[norm]
    expected = [-2 / scale[0], 0.0, 2 / scale[0], 0.0, -3 / scale[1], 3 / scale[1]]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_unknown_normalisation_is_refused():
    with pytest.raises(ValueError, match="batch"):
        group_advantages(torch.zeros(4), 2, norm="batch")


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)


def test_clip_advantages():
    assert torch.equal(clip_advantages(torch.tensor([-9.0, 0.5, 9.0]), 5.0), torch.tensor([-5.0, 0.5, 5.0]))


# ----------------------------------------------------------------- GDPO
def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


def test_gdpo_hand_computed():
    """Two groups of 3, rewards a (weight 1) and b (weight 2) of very different scales. Each
    reward's group advantages (centred, over the group's unbiased std):
      group 1: a (0, 1, 2) -> (-1, 0, 1);  b (10, 30, 20) -> (-1, 1, 0)
      group 2: a (4, 2, 0) -> (1, 0, -1);  b (0, 0, 300) -> (-1, -1, 2) / sqrt(3)
    their weighted sum a + 2 b, then that sum normalised over the 6 images."""
    scores = {"a": torch.tensor([0.0, 1, 2, 4, 2, 0]), "b": torch.tensor([10.0, 30, 20, 0, 0, 300])}
    s3 = math.sqrt(3)
    total = torch.tensor([-3.0, 2.0, 1.0, 1 - 2 / s3, -2 / s3, -1 + 4 / s3])
    expected = (total - total.mean()) / total.std()
    valid = torch.ones(6, dtype=torch.bool)
    advantages, per_reward = gdpo_advantages(scores, {"a": 1.0, "b": 2.0}, valid, group_size=3, eps=0.0)
    assert torch.allclose(per_reward["b"], torch.tensor([-1.0, 1, 0, -1 / s3, -1 / s3, 2 / s3]), atol=1e-6)
    assert torch.allclose(advantages, expected, atol=1e-6)


def test_weighted_sum_lets_the_larger_scale_decide_and_gdpo_does_not():
    """One prompt, two images: image 1 is slightly better on a reward of large scale, image 0
    much better on one of small scale that weighs more. The weighted sum prefers image 1
    (0.4 x 102 > 0.4 x 100 + 0.6 x 1); GDPO follows the weights and prefers image 0."""
    scores = {"large": torch.tensor([100.0, 102.0]), "small": torch.tensor([1.0, 0.0])}
    weights = {"large": 0.4, "small": 0.6}
    scores["reward"] = sum(w * scores[name] for name, w in weights.items())
    valid = torch.ones(2, dtype=torch.bool)
    summed, _ = aggregated_advantages(scores, weights, valid, 2, "weighted_sum")
    gdpo, _ = aggregated_advantages(scores, weights, valid, 2, "gdpo")
    assert summed[1] > 0 > summed[0]
    assert gdpo[0] > 0 > gdpo[1]


def test_under_gdpo_equal_weights_count_equally_whatever_the_scales():
    """Random rewards 1000 times apart in scale, equal weights: the weighted sum's advantages
    follow the large reward's own advantages alone; GDPO's correlate with both equally."""
    generator = torch.Generator().manual_seed(0)
    scores = {"large": 1000 * torch.rand(32, generator=generator), "small": torch.rand(32, generator=generator)}
    weights = {"large": 0.5, "small": 0.5}
    scores["reward"] = sum(w * scores[name] for name, w in weights.items())
    valid = torch.ones(32, dtype=torch.bool)
    own = {name: group_advantages(scores[name], 8, eps=0.0) for name in weights}
    summed, _ = aggregated_advantages(scores, weights, valid, 8, "weighted_sum")
    gdpo, _ = aggregated_advantages(scores, weights, valid, 8, "gdpo", eps=0.0)
    assert correlation(summed, own["large"]) > 0.999 and abs(correlation(summed, own["small"])) < 0.5
    assert math.isclose(correlation(gdpo, own["large"]), correlation(gdpo, own["small"]), abs_tol=1e-5)
    assert correlation(gdpo, own["small"]) > 0.5


def test_gdpo_normalises_each_reward_within_its_group():
    """A reward's scale in one group does not matter: multiplying reward b by 1000 in the
    second group only leaves every advantage as it was (it would not, were each reward
    divided by its batch std, or by nothing)."""
    generator = torch.Generator().manual_seed(1)
    scores = {"a": torch.rand(8, generator=generator), "b": torch.rand(8, generator=generator)}
    rescaled = {"a": scores["a"], "b": scores["b"] * torch.tensor([1.0] * 4 + [1000.0] * 4)}
    valid, weights = torch.ones(8, dtype=torch.bool), {"a": 1.0, "b": 1.0}
    before, _ = gdpo_advantages(scores, weights, valid, 4, eps=0.0)
    after, _ = gdpo_advantages(rescaled, weights, valid, 4, eps=0.0)
    assert torch.allclose(before, after, atol=1e-5)
    assert not torch.allclose(
        gdpo_advantages(scores, weights, valid, 4, norm="global")[0],
        gdpo_advantages(rescaled, weights, valid, 4, norm="global")[0],
        atol=1e-2,
    )


def test_gdpo_normalises_the_sum_over_the_batch():
    """The advantages have mean 0 and std 1 over the batch, whatever the weights' total: the
    advantage's range does not grow with the number of rewards or their weights."""
    generator = torch.Generator().manual_seed(2)
    scores = {name: torch.rand(12, generator=generator) for name in ("a", "b", "c")}
    valid = torch.ones(12, dtype=torch.bool)
    advantages, _ = gdpo_advantages(scores, {"a": 3.0, "b": 2.0, "c": 5.0}, valid, 4, eps=0.0)
    assert abs(float(advantages.mean())) < 1e-6 and math.isclose(float(advantages.std()), 1.0, rel_tol=1e-5)
    tenth, _ = gdpo_advantages(scores, {"a": 0.3, "b": 0.2, "c": 0.5}, valid, 4, eps=0.0)
    assert torch.allclose(advantages, tenth, atol=1e-5)


def test_gdpo_leaves_out_invalid_images():
    """An image without a finite reward gets advantage 0, and what it scored changes nothing
    for the others."""
    scores = {"a": torch.tensor([1.0, 5.0, 2.0, 0.0, 3.0, 1.0]), "b": torch.tensor([9.0, 1.0, 4.0, 2.0, 2.0, 7.0])}
    valid = torch.tensor([True, True, False, True, True, True])
    weights = {"a": 1.0, "b": 1.0}
    advantages, _ = gdpo_advantages(scores, weights, valid, 3)
    other = {name: values.clone() for name, values in scores.items()}
    other["a"][2], other["b"][2] = float("nan"), -50.0
    again, _ = gdpo_advantages(other, weights, valid, 3)
    assert advantages[2] == 0 and torch.isfinite(advantages).all()
    assert torch.equal(advantages, again)
    kept = advantages[valid]
    assert abs(float(kept.mean())) < 1e-6 and math.isclose(float(kept.std()), 1.0, rel_tol=1e-3)


def test_batch_normalised_with_too_few_images_gives_no_signal():
    values = torch.tensor([3.0, 1.0])
    assert torch.equal(batch_normalised(values, torch.tensor([True, False])), torch.zeros(2))


def test_aggregation_weighted_sum_is_the_advantage_of_the_sum():
    scores = {"a": torch.tensor([1.0, 2.0, 0.0, 4.0]), "b": torch.tensor([0.0, 10.0, 5.0, 5.0])}
    scores["reward"] = scores["a"] + 0.1 * scores["b"]
    valid = torch.tensor([True, True, True, False])
    advantages, metrics = aggregated_advantages(scores, {"a": 1.0, "b": 0.1}, valid, 2, "weighted_sum")
    assert torch.equal(advantages, masked_group_advantages(scores["reward"], valid, 2)) and metrics == {}


def test_gdpo_logs_each_rewards_advantage_spread():
    """reward/<name>/advantage_std: a reward that no longer varies within any group reads 0."""
    scores = {"a": torch.tensor([1.0, 2.0, 0.0, 4.0]), "b": torch.tensor([3.0, 3.0, 5.0, 5.0])}
    _, metrics = aggregated_advantages(scores, {"a": 1.0, "b": 1.0}, torch.ones(4, dtype=torch.bool), 2, "gdpo")
    assert set(metrics) == {"reward/a/advantage_std", "reward/b/advantage_std"}
    assert metrics["reward/a/advantage_std"] > 0.5 and metrics["reward/b/advantage_std"] == 0


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="mean"):
        aggregated_advantages({"reward": torch.zeros(4)}, {}, torch.ones(4, dtype=torch.bool), 2, "mean")
