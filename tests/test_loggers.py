"""What a user looks at is what was computed: the image grids wandb and tensorboard write,
decoded from their files, are the logged images."""

import io

import numpy as np
import torch
from PIL import Image

from omni.config.validate import validate
from omni.loggers import MetricsLogger, image_grid
from tests.conftest import compose_config


def tensorboard_images(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"images": 0})
    events.Reload()
    return [np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in events.Images("rollout/images")]


def test_each_backend_writes_the_images_it_was_given(tmp_path, tiny_cache):
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    cfg = validate(compose_config(["logger=all", "logger.wandb_mode=offline", f"model.cache_dir={tiny_cache}"], tmp_path))
    logger = MetricsLogger(cfg, tmp_path)
    logger.log_images(images, step=1)
    logger.close()
    expected = image_grid(images).permute(1, 2, 0).numpy() * 255

    wandb_png = next((tmp_path / "wandb").rglob("*.png"))
    written = {"wandb": np.asarray(Image.open(wandb_png).convert("RGB")), "tensorboard": tensorboard_images(tmp_path / "tensorboard")[0]}
    for backend, pixels in written.items():
        assert pixels.shape == expected.shape, backend
        assert np.abs(pixels.astype(np.float64) - expected).max() <= 0.5 + 1e-6, backend


def test_clips_are_logged_as_one_row_of_frames_each(tmp_path, tiny_cache):
    clips = torch.rand(2, 5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    cfg = validate(compose_config(["logger=tensorboard", f"model.cache_dir={tiny_cache}"], tmp_path))
    logger = MetricsLogger(cfg, tmp_path)
    logger.log_images(clips, step=1)
    logger.close()
    pixels = tensorboard_images(tmp_path / "tensorboard")[0].astype(np.float64)
    assert pixels.shape == (2 * 8, 5 * 8, 3)
    second_clip_third_frame = clips[1, 2].permute(1, 2, 0).numpy() * 255
    assert np.abs(pixels[8:16, 16:24] - second_clip_third_frame).max() <= 0.5 + 1e-6
