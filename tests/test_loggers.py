"""What a user looks at is what was computed: the image grids wandb and tensorboard write,
decoded from their files, are the logged images."""

import io

import numpy as np
import torch
from PIL import Image

from omni.loggers import MetricsLogger, image_grid
from omni.validation import validate
from tests.conftest import compose_config


def tensorboard_images(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"images": 0})
    events.Reload()
    return [np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in events.Images("rollout/images")]


def test_each_backend_writes_the_images_it_was_given(tmp_path, tiny_cache):
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    cfg = validate(
        compose_config(["logger=all", "logger.wandb_mode=offline", f"model.cache_dir={tiny_cache}"], tmp_path)
    )
    logger = MetricsLogger(cfg, tmp_path)
    logger.log_images(images, step=1)
    logger.close()
    expected = image_grid(images).permute(1, 2, 0).numpy() * 255

    wandb_png = next((tmp_path / "wandb").rglob("*.png"))
    written = {
        "wandb": np.asarray(Image.open(wandb_png).convert("RGB")),
        "tensorboard": tensorboard_images(tmp_path / "tensorboard")[0],
    }
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


def test_clips_are_written_as_videos_each_backend_can_decode(tmp_path, tiny_cache):
    from omni.videos import read_video

    # smooth frames (a lossy codec keeps them), each clip fading its own way over time
    ramp = torch.linspace(0, 1, 16).view(1, 1, 1, 16).expand(5, 3, 16, 16)
    fade = torch.linspace(0.1, 0.9, 5).view(5, 1, 1, 1)
    clips = torch.stack([0.5 * ramp + 0.5 * fade, 0.5 * ramp.flip(-1) + 0.5 * fade.flip(0)])
    cfg = validate(
        compose_config(
            ["logger=all", "logger.wandb_mode=offline", f"model.cache_dir={tiny_cache}", "rollout.fps=8"], tmp_path
        )
    )
    logger = MetricsLogger(cfg, tmp_path)
    logger.log_images(clips, step=3)
    logger.close()
    expected = torch.stack([image_grid(clips[:, t]) for t in range(5)])  # (5, 3, 16, 32)

    mp4 = tmp_path / "videos" / "rollout_videos_000003.mp4"
    frames = read_video(mp4)
    assert frames.shape == expected.shape
    assert (frames - expected).abs().mean() < 0.02  # lossy, but these frames, in this order
    assert (frames - expected.flip(0)).abs().mean() > 0.1
    wandb_mp4 = next((tmp_path / "wandb").rglob("*.mp4"))
    assert read_video(wandb_mp4).shape == expected.shape

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    gif = Image.open(io.BytesIO(events.Images("rollout/videos")[0].encoded_image_string))
    assert (gif.n_frames, gif.size) == (5, (32, 16))
    gif.seek(2)
    third = torch.from_numpy(np.array(gif.convert("RGB"))).permute(2, 0, 1).float() / 255
    assert (third - expected[2]).abs().mean() < 0.05


def test_video_logging_without_an_mp4_encoder_fails_at_validation(tmp_path, tiny_cache, monkeypatch):
    import pytest

    from omni.config.errors import ConfigError

    monkeypatch.setitem(__import__("sys").modules, "cv2", None)  # as if OpenCV were not installed
    overrides = ["model=wan_tiny", "reward=frame_brightness", f"model.cache_dir={tiny_cache}"]
    validate(compose_config(overrides, tmp_path))  # no video logged: no encoder needed
    with pytest.raises(ConfigError, match=r"logger.image_every=2 .*omni-recipes\[video\]"):
        validate(compose_config(overrides + ["logger.image_every=2"], tmp_path))


def test_video_logging_warns_of_nothing(tmp_path, tiny_cache, capfd, monkeypatch):
    """wandb warns when given an fps with a file (the mp4 carries its own frame rate)."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "false")  # wandb's warnings printed, as a user sees them
    wandb.teardown()  # so that wandb reads its settings again (an earlier run in this process read them)
    cfg = validate(
        compose_config(
            ["logger=wandb", "logger.wandb_mode=offline", f"model.cache_dir={tiny_cache}", "rollout.fps=8"], tmp_path
        )
    )
    logger = MetricsLogger(cfg, tmp_path)
    logger.log_images(torch.rand(2, 3, 3, 8, 8), step=1)
    logger.close()
    captured = capfd.readouterr()
    assert "wandb" in captured.err  # wandb speaks here (its sync hint), so a warning would show
    assert "WARNING" not in captured.out + captured.err, captured.err


def test_run_name_group_and_tags_reach_the_backends(tmp_path, tiny_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    named = ["logger.run_name=lr-3e-4", "logger.group=sweep-a", "logger.tags=[tiny,cosine]"]
    cfg = validate(
        compose_config(["logger=all", "logger.wandb_mode=offline", f"model.cache_dir={tiny_cache}", *named], tmp_path)
    )
    logger = MetricsLogger(cfg, tmp_path)
    run = logger.wandb
    assert (run.name, run.group, tuple(run.tags)) == ("lr-3e-4", "sweep-a", ("tiny", "cosine"))
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == "name: lr-3e-4, group: sweep-a, tags: tiny, cosine"


def test_a_logger_backend_not_installed_is_named_with_its_extra(tmp_path, tiny_cache):
    import importlib.util

    import pytest

    from omni.config.errors import ConfigError

    if importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here")
    with pytest.raises(
        ConfigError, match=r"logger.backends has mlflow, which is not installed: pip install 'omni-recipes\[mlflow\]'"
    ):
        validate(compose_config(["logger=mlflow", f"model.cache_dir={tiny_cache}"], tmp_path))
