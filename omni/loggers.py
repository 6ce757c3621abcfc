"""Metric, image and video logging to the console, wandb (offline by default) and tensorboard;
held-out evaluation images with their prompts and scores (`log_eval_samples`).

A video model's rollout clips (B, F, 3, H, W) are logged as a grid image (one row of frames
per clip) and as a video whose every frame is a grid of the clips' frames at that time: an mp4
file in the run directory (`videos/<tag>_<step>.mp4`), that file as a `wandb.Video`, and an
animated GIF image summary in tensorboard (what `SummaryWriter.add_video` writes; it is
written here because `add_video` encodes with moviepy 1.x, whose `moviepy.editor` is gone
from moviepy 2, and otherwise logs nothing but a printed line).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def image_grid(images: torch.Tensor, columns: int = 8) -> torch.Tensor:
    """(B, 3, H, W) -> one (3, rows*H, columns*W) image."""
    b, c, h, w = images.shape
    columns = min(columns, b)
    rows = -(-b // columns)
    padded = torch.zeros(rows * columns, c, h, w)
    padded[:b] = images
    return padded.reshape(rows, columns, c, h, w).permute(2, 0, 3, 1, 4).reshape(c, rows * h, columns * w)


# The import behind each optional backend, and the extra that installs it.
BACKEND_IMPORTS = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
}


def missing_backends(backends) -> Dict[str, str]:
    """{backend: what to install} for the chosen backends whose package is not installed."""
    import importlib.util

    missing = {}
    for backend in backends:
        module, extra = BACKEND_IMPORTS.get(backend, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            missing[backend] = f"pip install 'omni-recipes[{extra}]'"
    return missing


class MetricsLogger:
    def __init__(self, cfg, output_dir: Path):
        self.output_dir = Path(output_dir)
        self.fps = cfg.rollout.fps or cfg.model.fps
        self.backends = [backend.value for backend in cfg.logger.backends]
        self.console_every = cfg.logger.console_every
        self.wandb = self.tensorboard = self.mlflow = None
        self.history: List[Tuple[int, Dict[str, float]]] = []  # every (step, metrics) logged, for omni/results.py
        config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
        run = cfg.logger
        if "wandb" in self.backends:
            import wandb

            self.wandb = wandb.init(
                project=run.wandb_project,
                mode=run.wandb_mode.value,
                dir=str(output_dir),
                config=config,
                name=run.run_name,
                group=run.group,
                tags=list(run.tags) or None,
            )
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
            self.tensorboard.add_text(
                "run", f"name: {run.run_name}, group: {run.group}, tags: {', '.join(run.tags)}", 0
            )
        if "mlflow" in self.backends:
            self.mlflow = start_mlflow_run(run, self.output_dir, config)

    def log(self, metrics: Dict[str, float], step: int, force_console: bool = False) -> None:
        """`metrics` to every backend; the console backend writes them through `logging` (the
        console and Hydra's `<job>.log` in the run directory) every `console_every` steps; all
        of them are kept in `history`."""
        self.history.append((step, dict(metrics)))
        if "console" in self.backends and (force_console or step % self.console_every == 0):
            shown = " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
            log.info("step %d: %s", step, shown)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(metrics, step=step)

    def log_images(self, images: torch.Tensor, step: int, tag: str = "rollout/images") -> None:
        """One grid of `images` (in [0, 1]; clips: a row of frames each) to every image backend, as 8-bit pixels: wandb
        casts a float array to uint8 without scaling, which would turn the grid black."""
        images = images.float().cpu()
        if images.ndim == 5:  # clips (B, F, 3, H, W): one row of frames per clip, at most 8 clips
            grid = image_grid(images[:8].flatten(0, 1), columns=images.shape[1])
            self.log_video(images, step, tag.replace("images", "videos"))
        else:
            grid = image_grid(images)
        pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8)
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(pixels.permute(1, 2, 0).numpy())}, step=step)
        if self.tensorboard is not None:
            self.tensorboard.add_image(tag, pixels, step)

    def log_eval_samples(
        self, images: torch.Tensor, prompts: Sequence[str], scores: Dict[str, torch.Tensor], step: int
    ) -> None:
        """Held-out images (in [0, 1]; clips: their first frame) with each one's prompt and
        scores (`scores[name][i]` for image i), at the step of the evaluation's metrics: a
        wandb table, and in tensorboard one image each (eval/images/<i>) with a text table of
        the captions (eval/images)."""
        images = images.float().cpu()
        if images.ndim == 5:
            images = images[:, 0]
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8)
        captions = [
            f"{prompt} | " + ", ".join(f"{name}={float(values[i]):.4g}" for name, values in scores.items())
            for i, prompt in enumerate(prompts[: len(pixels)])
        ]
        if self.wandb is not None:
            import wandb

            columns = ["image", "prompt", *scores]
            rows = [
                [wandb.Image(pixels[i].permute(1, 2, 0).numpy(), caption=captions[i]), str(prompts[i])]
                + [float(values[i]) for values in scores.values()]
                for i in range(len(pixels))
            ]
            self.wandb.log({"eval/samples": wandb.Table(columns=columns, data=rows)}, step=step)
        if self.tensorboard is not None:
            for i, image in enumerate(pixels):
                self.tensorboard.add_image(f"eval/images/{i}", image, step)
            table = "\n".join(["| image | prompt and scores |", "|---|---|"])
            table += "".join(f"\n| {i} | {caption} |" for i, caption in enumerate(captions))
            self.tensorboard.add_text("eval/images", table, step)

    def log_video(self, clips: torch.Tensor, step: int, tag: str = "rollout/videos") -> Optional[Path]:
        """Clips (B, F, 3, H, W) in [0, 1], at most 8 side by side, as one video: an mp4 file in
        the run directory (returned), a wandb.Video of it, a tensorboard GIF."""
        from omni.videos import gif_bytes, write_mp4

        clips = clips.float().cpu()[:8]
        frames = torch.stack([image_grid(clips[:, t]) for t in range(clips.shape[1])])
        path = write_mp4(self.output_dir / "videos" / f"{tag.replace('/', '_')}_{step:06d}.mp4", frames, self.fps)
        if self.wandb is not None:
            import wandb

            # the mp4 carries its frame rate; wandb ignores (and warns about) an fps given with a file
            self.wandb.log({tag: wandb.Video(str(path), format="mp4")}, step=step)
        if self.tensorboard is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            _, _, height, width = frames.shape
            image = Summary.Image(
                height=height, width=width, colorspace=3, encoded_image_string=gif_bytes(frames, self.fps)
            )
            self.tensorboard._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
        return path

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.mlflow is not None:
            self.mlflow.end_run()


def start_mlflow_run(run, output_dir: Path, config: dict):
    """An mlflow run (the module, with its active run) named and tagged as `logger` says, in
    the experiment `logger.group`, recording to `logger.mlflow_tracking_uri` (or the run
    directory's `mlruns/`)."""
    import mlflow

    mlflow.set_tracking_uri(run.mlflow_tracking_uri or (output_dir / "mlruns").resolve().as_uri())
    if run.group:
        mlflow.set_experiment(run.group)
    mlflow.start_run(run_name=run.run_name, tags={tag: "true" for tag in run.tags})
    mlflow.log_dict(config, "config.json")
    return mlflow
