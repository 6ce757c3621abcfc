"""Reward functions on constructed images, and the weighted combination."""

import pytest
import torch

from omni.rewards import WeightedReward, check_reward_names
from omni.rewards.brightness import brightness
from omni.rewards.color import color
from omni.rewards.jpeg import jpeg_compressibility


def test_brightness_orders_images():
    images = torch.stack([torch.full((3, 8, 8), v) for v in (0.1, 0.5, 0.9)])
    assert torch.allclose(brightness(images, [""] * 3), torch.tensor([0.1, 0.5, 0.9]))


def test_color_follows_the_prompt():
    red = torch.zeros(3, 8, 8)
    red[0] = 1
    blue = torch.zeros(3, 8, 8)
    blue[2] = 1
    images = torch.stack([red, blue, red])
    scores = color(images, ["a red cat", "a red cat", "a photo"])
    assert scores[0] == pytest.approx(1.0) and scores[1] < 0.3 and scores[2] == 0


def test_jpeg_prefers_flat_images():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noisy = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    scores = jpeg_compressibility(torch.cat([flat, noisy]), ["", ""])
    assert scores[0] > scores[1]


def test_weighted_sum_and_chunks():
    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = ["a red cat"] * 5
    scores = WeightedReward({"brightness": 2.0, "color": -1.0}, batch_size=2)(images, prompts)
    assert torch.allclose(scores["reward"], 2 * brightness(images, prompts) - color(images, prompts))


def test_unknown_reward_lists_the_available():
    with pytest.raises(ValueError, match="unknown reward.*'aesthetic'.*available"):
        check_reward_names({"aesthetic": 1.0})
