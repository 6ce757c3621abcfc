"""Video rewards on hand-made clips: an image reward averaged over each clip's frames (its
options typed as its own), and the temporal consistency of consecutive frames."""

import pytest
import torch

from omni.rewards import WeightedReward
from omni.rewards.brightness import brightness
from omni.rewards.temporal_consistency import temporal_consistency


def clip(*levels, size=8):
    """A clip (F, 3, H, W) whose frame t is uniformly grey at levels[t]."""
    return torch.stack([torch.full((3, size, size), float(v)) for v in levels])


def test_frame_average_is_the_mean_of_each_frames_image_reward():
    reward = WeightedReward({"frame_average": {"image": "brightness"}})
    clips = torch.stack([clip(0.2, 0.4, 0.9), clip(1.0, 1.0, 1.0)])
    scores = reward(clips, ["a", "b"])
    assert torch.allclose(scores["frame_brightness"], torch.tensor([0.5, 1.0]))
    # a frame's reward counts once: the clip's mean is not the reward of its mean frame for a non-linear reward
    jpeg = WeightedReward({"frame_average": {"image": "jpeg_compressibility", "image_options": {"quality": 50}}})
    noisy = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    noisy[0, 1:] = 0.5
    per_frame = torch.stack([jpeg.rewards["frame_average"].inner.score(c, ["a"] * 3) for c in noisy])
    assert torch.allclose(jpeg(noisy, ["a", "b"])["frame_jpeg_compressibility"], per_frame.mean(1))
    assert jpeg.rewards["frame_average"].inner.options.quality == 50


def test_frame_average_passes_each_frame_the_clips_prompt():
    reward = WeightedReward({"frame_average": {"image": "color"}})
    red = clip(1, 0.5, 0)
    red[:, 1:] = 0  # pure red frames, then a grey and a black one
    scores = reward(torch.stack([red, red]), ["a red car", "a blue car"])["frame_color"]
    assert scores[0] > scores[1]


def test_frame_average_options_are_the_image_rewards():
    with pytest.raises(ValueError, match="image_options.*quality"):
        WeightedReward({"frame_average": {"image": "jpeg_compressibility", "image_options": {"qualty": 3}}})
    with pytest.raises(ValueError, match="frame_average.image=nope: no such reward"):
        WeightedReward({"frame_average": {"image": "nope"}})


def test_temporal_consistency_of_still_flickering_and_smooth_clips():
    still = clip(0.9, 0.9, 0.9, 0.9)
    inverted = torch.stack([still[0], 1 - still[0]])  # a frame then its negative
    pattern = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(1))
    other = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(2))
    smooth = torch.stack([pattern * (1 - t / 8) + other * t / 8 for t in range(4)])  # blending into another pattern
    flicker = torch.stack([pattern, 1 - pattern, pattern, 1 - pattern])
    scores = torch.cat([temporal_consistency(c[None]) for c in (still, inverted, smooth, flicker)])
    assert torch.allclose(scores[:2], torch.tensor([1.0, -1.0]), atol=1e-6)
    assert 0.9 < scores[2] < 1 and scores[3] < 0
    assert temporal_consistency(still[None, :1]).item() == 1.0  # one frame: nothing changes
    # consecutive frames, not each frame against the first: A A -A -A changes once, cosines 1, -1, 1
    once = torch.stack([pattern, pattern, 1 - pattern, 1 - pattern])
    assert torch.allclose(temporal_consistency(once[None]), torch.tensor([1 / 3]), atol=1e-6)


def test_video_rewards_are_marked_and_image_rewards_are_not():
    from omni.rewards import REWARDS

    assert REWARDS.get("frame_average").video and REWARDS.get("temporal_consistency").video
    assert not REWARDS.get("brightness").video
    assert torch.allclose(brightness(clip(0.3, 0.3), None), torch.tensor([0.3, 0.3]))
