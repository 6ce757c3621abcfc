"""Reward functions on constructed images, and the weighted combination."""

import pytest
import torch

from omni.rewards import REWARDS, WeightedReward, reward_options
from omni.rewards.brightness import brightness
from omni.rewards.color import color
from omni.rewards.jpeg_compressibility import JpegOptions, jpeg_compressibility


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
    reward = WeightedReward({"brightness": {"weight": 2.0}, "color": {"weight": -1.0, "batch_size": 3}}, batch_size=2)
    scores = reward(images, prompts)
    assert torch.allclose(scores["reward"], 2 * brightness(images, prompts) - color(images, prompts))
    assert torch.equal(scores["color"], color(images, prompts)) and set(scores) == {"reward", "brightness", "color"}


def test_component_options_are_typed():
    options = reward_options("jpeg_compressibility", {"weight": 0.5, "quality": 50})
    assert isinstance(options, JpegOptions) and options.quality == 50
    noisy = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    low, high = (WeightedReward({"jpeg_compressibility": {"quality": q}})(noisy, [""])["reward"] for q in (30, 95))
    assert low > high  # the option reaches the scorer: a lower quality makes a smaller file
    with pytest.raises(ValueError, match="reward.components.jpeg_compressibility.*qualty"):
        reward_options("jpeg_compressibility", {"qualty": 50})


def test_unknown_reward_lists_the_available():
    with pytest.raises(KeyError, match="reward.components=aesthetics.*available.*brightness"):
        reward_options("aesthetics", {})
    expected = {"brightness", "color", "jpeg_compressibility", "http", "ocr", "pickscore", "clipscore", "aesthetic"}
    assert expected <= set(REWARDS.names()) and not {"base", "protocol", "serve", "clip_base"} & set(REWARDS.names())


def test_a_missing_mandatory_option_names_the_component():
    with pytest.raises(ValueError, match="reward.components.pickscore: .*missing mandatory value: path"):
        reward_options("pickscore", {})


def test_setup_and_teardown_reach_each_component():
    calls = []

    class Probe(REWARDS.get("brightness")):
        def setup(self):
            calls.append(("setup", self.name))

        def teardown(self):
            calls.append(("teardown", self.name))

    reward = WeightedReward({"brightness": {}})
    reward.rewards["brightness"] = Probe("brightness", reward.rewards["brightness"].options)
    reward.setup()
    reward.teardown()
    assert calls == [("setup", "brightness"), ("teardown", "brightness")]
