"""Temporal consistency of a clip: the mean cosine similarity of its consecutive frames.

Each frame is taken as one vector of its pixels mapped to [-1, 1] (mid-grey at 0), so the
cosine measures whether consecutive frames keep the same light and dark regions: a still
clip scores 1, a frame followed by its negative -1, and a clip that flickers scores less
than one that changes smoothly. A clip of one frame scores 1.
"""

import torch
import torch.nn.functional as F

from omni.rewards.base import Reward


def temporal_consistency(clips: torch.Tensor) -> torch.Tensor:
    """Clips (B, F, 3, H, W) in [0, 1] -> mean cosine similarity of frames t and t + 1, (B,)."""
    frames = (clips.float() * 2 - 1).flatten(2)
    if frames.shape[1] < 2:
        return torch.ones(len(frames))
    return F.cosine_similarity(frames[:, 1:], frames[:, :-1], dim=-1, eps=1e-6).mean(1)


class TemporalConsistency(Reward):
    video = True

    def score(self, clips, prompts):
        return temporal_consistency(clips)


REWARD = TemporalConsistency
