"""A video model's preference pairs: clips as mp4 files or frame folders, read back as frames;
an undecodable video or a clip of the wrong length is named by file and line before any
model loads."""

import json

import numpy as np
import pytest

from omni.data.pair_sources import load_preference_pairs
from omni.data.preferences import images_to_tensor
from omni.data.synthetic_pairs import write_synthetic_video_pairs


@pytest.fixture(scope="module")
def video_pairs(tmp_path_factory):
    return write_synthetic_video_pairs(
        tmp_path_factory.mktemp("video_pairs"), n_pairs=4, resolution=16, num_frames=5, seed=0
    )


def test_mp4_and_frame_folder_clips_read_back_as_their_frames(video_pairs):
    rows = [json.loads(line) for line in video_pairs.read_text().splitlines()]
    assert rows[0]["chosen"].endswith(".mp4") and (video_pairs.parent / rows[1]["chosen"]).is_dir()
    pairs, stats = load_preference_pairs(video_pairs, num_frames=5)
    assert stats["pairs"] == 4
    for pair in pairs:
        assert pair.chosen.shape == pair.rejected.shape == (5, 16, 16, 3)
        gap = (pair.chosen.astype(np.float64) - pair.rejected).mean() / 255
        assert 0.17 < gap < 0.23  # 2 x BRIGHTNESS_GAP, through a lossy codec for the mp4 pairs
    batch = images_to_tensor([pairs[0].chosen, pairs[1].chosen], 8)
    assert batch.shape == (2, 5, 3, 8, 8)  # resized per frame, (B, F, 3, H, W) for the VAE


def _rewrite(jsonl, line, **columns):
    rows = [json.loads(text) for text in jsonl.read_text().splitlines()]
    rows[line - 1].update(columns)
    out = jsonl.with_name("edited.jsonl")
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out


def test_an_undecodable_video_is_named_with_its_file_and_line(video_pairs):
    (video_pairs.parent / "clips" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    edited = _rewrite(video_pairs, 3, rejected="clips/broken.mp4")
    with pytest.raises(ValueError, match=r"edited.jsonl, line 3: column 'rejected': cannot decode video .*broken.mp4"):
        load_preference_pairs(edited, num_frames=5)
    _, stats = load_preference_pairs(edited, skip_bad_rows=True, num_frames=5)
    assert stats["skipped_bad"] == 1 and stats["pairs"] == 3


def test_a_clip_of_the_wrong_length_is_named_with_its_file_and_line(video_pairs):
    with pytest.raises(
        ValueError, match=r"pairs.jsonl, line 1: video .*pair_00000_chosen.mp4 .* has 5 frames; .*rollout.num_frames=9"
    ):
        load_preference_pairs(video_pairs, num_frames=9)
    folder = video_pairs.parent / "clips" / "pair_00001_chosen"
    (folder / "0004.png").rename(folder.parent / "moved.png")  # a 4-frame folder: not 4k+1
    try:
        with pytest.raises(ValueError, match=r"line 2: video .*pair_00001_chosen in column 'chosen' has 4 frames"):
            load_preference_pairs(video_pairs, num_frames=5)
    finally:
        (folder.parent / "moved.png").rename(folder / "0004.png")


def test_a_missing_video_is_named(video_pairs):
    edited = _rewrite(video_pairs, 2, chosen="clips/nowhere.mp4")
    with pytest.raises(ValueError, match=r"line 2: column 'chosen': video not found: .*nowhere.mp4"):
        load_preference_pairs(edited, num_frames=5)
