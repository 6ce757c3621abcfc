"""StreamedScores: a rollout scored part by part on a background thread gives the scores of
scoring the whole afterwards, bit for bit, and a scoring failure stops the sampling at the
next part."""

import threading

import pytest
import torch

from omni.rewards import WeightedReward
from omni.rewards.base import RewardUnavailable
from omni.rewards.streaming import StreamedScores

# channels-last, as a VAE decodes them: a mean's rounding depends on the strides
IMAGES = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)).contiguous(
    memory_format=torch.channels_last
)
PROMPTS = [f"prompt {i}" for i in range(8)]


def test_parts_give_the_scores_of_scoring_afterwards():
    reward = WeightedReward({"brightness": {"batch_size": 2, "weight": 0.3}, "jpeg_compressibility": {"weight": 0.7}})
    calls = []
    score = reward.rewards["brightness"].score
    reward.rewards["brightness"].score = lambda images, prompts: (
        calls.append((list(prompts), threading.current_thread().name)) or score(images, prompts)
    )
    afterwards = reward(IMAGES, PROMPTS, part=3)
    batches = [p for p, _ in calls]
    calls.clear()
    with StreamedScores(reward, len(PROMPTS)) as stream:
        for start in range(0, 8, 3):
            stream.add(IMAGES[start : start + 3], PROMPTS[start : start + 3])
        streamed = stream.result()
    assert set(streamed) == set(afterwards) == {"reward", "brightness", "jpeg_compressibility"}
    assert all(torch.equal(streamed[k], afterwards[k]) for k in afterwards)
    assert torch.equal(streamed["reward"], 0.3 * streamed["brightness"] + 0.7 * streamed["jpeg_compressibility"])
    # each part in calls of at most the batch size, never across parts: the same calls either way
    assert [p for p, _ in calls] == batches == [PROMPTS[0:2], PROMPTS[2:3], PROMPTS[3:5], PROMPTS[5:6], PROMPTS[6:8]]
    assert threading.current_thread().name not in {thread for _, thread in calls}  # scored in the background


def test_a_failed_scoring_stops_the_next_part():
    reward = WeightedReward({"brightness": {}})

    def unavailable(images, prompts):
        raise RewardUnavailable("reward 'brightness': the server went away")

    reward.rewards["brightness"].score = unavailable
    with StreamedScores(reward, len(PROMPTS)) as stream:
        stream.add(IMAGES[:2], PROMPTS[:2])
        stream.futures[0].exception()  # waits for the first part's scoring
        with pytest.raises(RewardUnavailable, match="server went away"):
            stream.add(IMAGES[2:4], PROMPTS[2:4])
    with StreamedScores(WeightedReward({"brightness": {}}), 8) as stream:
        stream.add(IMAGES[:4], PROMPTS[:4])
        with pytest.raises(ValueError, match="4 of 8 images were added"):
            stream.result()
