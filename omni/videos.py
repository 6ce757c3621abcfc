"""Video files: clips written as mp4 and read back from mp4 files or frame folders.

A clip is a float tensor (F, 3, H, W) in [0, 1]. mp4 files are VP9 in an MPEG-4 container
(browsers play it, so wandb's page does), written and read with OpenCV's FFmpeg backend:
the optional `video` extra (`pip install 'omni-recipes[video]'`); without it, writing or
reading an mp4 is an error that says so. A frame folder (PNG/JPEG files, in name order)
needs only Pillow.

`gif_bytes` encodes a clip as an animated GIF, which is what tensorboard shows for a video
(its `add_video` writes exactly such an image summary, but encodes it with moviepy 1.x,
whose `moviepy.editor` is gone from moviepy 2: see `omni.loggers`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import List

import numpy as np
import torch
from PIL import Image

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
FOURCC = "vp09"


class VideoError(ValueError):
    """A video file or frame folder that cannot be read (its path is in the message)."""


def _cv2():
    try:
        import cv2
    except ImportError as error:
        raise ImportError("mp4 video files need OpenCV: pip install 'omni-recipes[video]'") from error
    return cv2


def video_backend_missing() -> str:
    """'' when mp4 files can be written and read, else why not (for validation)."""
    try:
        _cv2()
    except ImportError as error:
        return str(error)
    return ""


def to_uint8_frames(clip: torch.Tensor) -> np.ndarray:
    """(F, 3, H, W) in [0, 1] -> (F, H, W, 3) uint8, rounded."""
    return (clip.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def write_mp4(path, clip: torch.Tensor, fps: int) -> Path:
    """Write `clip` (F, 3, H, W) in [0, 1] to `path` as an mp4 file; returns the path."""
    cv2 = _cv2()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = to_uint8_frames(clip)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*FOURCC), float(fps), (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {FOURCC} mp4 files here ({path}); its FFmpeg build lacks the encoder")
    try:
        for frame in frames:
            writer.write(np.ascontiguousarray(frame[..., ::-1]))  # OpenCV takes BGR
    finally:
        writer.release()
    return path


def _read_mp4(path: Path) -> List[np.ndarray]:
    cv2 = _cv2()
    capture = cv2.VideoCapture(str(path))
    frames = []
    try:
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(frame[..., ::-1])
    finally:
        capture.release()
    if not frames:
        raise VideoError(
            f"cannot decode video {path}: no frame could be read (not a video, or a codec this OpenCV lacks)"
        )
    return frames


def _read_folder(path: Path) -> List[np.ndarray]:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not files:
        raise VideoError(f"frame folder {path} holds no image file ({', '.join(FRAME_SUFFIXES)})")
    frames = []
    for file in files:
        try:
            with Image.open(file) as image:
                frames.append(np.asarray(image.convert("RGB")))
        except Exception as error:  # PIL raises several types for corrupt data
            raise VideoError(f"cannot read frame {file}: {error}") from error
    if len({f.shape for f in frames}) > 1:
        raise VideoError(f"frame folder {path}: frames differ in size ({sorted({f.shape[:2] for f in frames})})")
    return frames


def read_frames(path) -> np.ndarray:
    """An mp4 file or a folder of frames -> uint8 (F, H, W, 3); raises VideoError."""
    path = Path(path)
    if not path.exists():
        raise VideoError(f"video not found: {path}")
    return np.stack(_read_folder(path) if path.is_dir() else _read_mp4(path))


def read_video(path) -> torch.Tensor:
    """An mp4 file or a folder of frames -> (F, 3, H, W) float in [0, 1]; raises VideoError."""
    return torch.from_numpy(read_frames(path)).permute(0, 3, 1, 2).float() / 255


def count_frames(path) -> int:
    """The frames of an mp4 file (its container's count, after its first frame decodes) or of
    a frame folder (its image files, each header read), without decoding the clip; raises VideoError."""
    path = Path(path)
    if not path.exists():
        raise VideoError(f"video not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not files:
            raise VideoError(f"frame folder {path} holds no image file ({', '.join(FRAME_SUFFIXES)})")
        for file in files:
            try:
                with Image.open(file):
                    pass
            except Exception as error:  # PIL raises several types for corrupt data
                raise VideoError(f"cannot read frame {file}: {error}") from error
        return len(files)
    cv2 = _cv2()
    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened() or not capture.read()[0]:
            raise VideoError(f"cannot decode video {path}: not a video, or a codec this OpenCV lacks")
        return int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        capture.release()


def gif_bytes(clip: torch.Tensor, fps: int) -> bytes:
    """`clip` (F, 3, H, W) in [0, 1] as an animated GIF that loops."""
    images = [Image.fromarray(frame) for frame in to_uint8_frames(clip)]
    out = io.BytesIO()
    images[0].save(
        out, format="GIF", save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0
    )
    return out.getvalue()
