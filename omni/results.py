"""The results bundle a finished training run leaves in `<run dir>/results/`:

    config.yaml    the resolved, validated config the run used
    manifest.json  package versions, the machine (CPU, cores, torch threads), the code's git
                   commit (and whether its tree was dirty), sha256 of the final checkpoint's
                   files and of the prompt files, the command line and Hydra overrides, the
                   date, and the checkpoint the bundle describes
    metrics.json   the final evaluation's metrics, its mean reward per category (prompts whose
                   metadata carries a `tag`: GenEval's and omni.scenes' six categories) and the
                   per-image held-out rewards before and after training (the run's eval.json)
    history.json   every logged metric, {key: [[step, value], ...]}
    report.html    all of it on one self-contained page (omni/report.py)

`write_results` takes plain values, not the trainer. Non-finite numbers are written as JSON
null. A step logged twice (a sentinel rollback runs steps again) keeps its last value.

A bundle is never written over unless its writer made it: the manifest records, as
`made_by`, the checkpoint it describes (its path relative to the run directory), and a
writer replaces a bundle only when that checkpoint is among its `replaces` (a resumed run:
the checkpoints of the run it continues, whose history it then carries on). A `results/`
without that record, or of another run, is refused (ResultsNotOurs). The directory appears
whole or not at all (omni.atomic).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from omni import report
from omni.atomic import write_directory
from omni.config.errors import ConfigError
from omni.data.prompts import resolve_prompt_file
from omni.evaluation import category, prompt_source

RESULTS_DIR = "results"
FILES = ("config.yaml", "manifest.json", "metrics.json", "history.json", "report.html")
# The distributions whose versions the manifest records (None: not installed).
PACKAGES = ("torch", "diffusers", "peft", "transformers", "hydra-core", "omegaconf", "verl")
REPORT_IMAGES = 64  # held-out images on the page at most: the first seed of each prompt, in order
CODE_DIR = Path(__file__).resolve().parents[1]  # the checkout holding the `omni` package, if it is one

History = Dict[str, List[Tuple[int, float]]]  # key -> [(step, value)], steps ascending


class ResultsNotOurs(ConfigError):
    """A results directory this run did not make (and so never writes over)."""


# ---------------------------------------------------------------- ownership
def made_by(directory: Path) -> Optional[str]:
    """The checkpoint a bundle records as its own (None: no readable record)."""
    try:
        return json.loads((Path(directory) / "manifest.json").read_text())["made_by"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_replaceable(directory: Path, replaces: Iterable[str] = ()) -> bool:
    """True when `directory` holds a bundle made by one of `replaces`, False when there is
    none; ResultsNotOurs, naming it and what made it, for anything else."""
    directory = Path(directory)
    if not directory.exists():
        return False
    owner = made_by(directory)
    if owner is not None and owner in set(replaces):
        return True
    made = f"made by the run that saved {owner}" if owner else "not made by a training run (no manifest.json made_by)"
    raise ResultsNotOurs(
        f"{directory} exists, {made}; this run does not continue that run and never writes over what it did not "
        f"make. Move {directory} away, or give this run its own directory (hydra.run.dir=...)"
    )


# ---------------------------------------------------------------- manifest
def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_versions() -> Dict[str, Optional[str]]:
    versions: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_name() -> Optional[str]:
    """The CPU's model name as the kernel reports it (Linux), else the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine() -> Dict[str, Any]:
    """What a run's timings depend on: the CPU, its cores and the torch threads the run used
    (timings from different CPUs are not comparable; the same code ran 2x apart on two 2-core
    machines)."""
    import torch

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def git_state(code_dir: Path = CODE_DIR) -> Dict[str, Any]:
    """{"commit", "dirty"} of the git checkout whose root is `code_dir`; both None when it
    is not one (an installed package) or git is missing. Dirty: uncommitted changes, or
    files git does not ignore and does not track."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(code_dir), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        # an installed package may sit inside someone else's checkout (a venv in a repo)
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(code_dir).resolve():
            return {"commit": None, "dirty": None}
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def relative_name(path: Path, root: Path) -> str:
    path = Path(path).resolve()
    try:
        return path.relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def manifest(
    run_dir: Path,
    checkpoint_files: Sequence[Path],
    prompt_files: Mapping[str, Path],
    overrides: Sequence[str],
    made_by: str,
    command: Sequence[str],
) -> Dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "made_by": made_by,
        "command": list(command),
        "overrides": list(overrides),
        "packages": package_versions(),
        "machine": machine(),
        "git": git_state(),
        "checkpoint": {relative_name(p, run_dir): sha256(p) for p in sorted(map(Path, checkpoint_files))},
        "prompts": {role: {"file": str(path), "sha256": sha256(path)} for role, path in prompt_files.items()},
    }


# ---------------------------------------------------------------- metrics
def per_category(tags: Sequence[Optional[str]], scores: Sequence[float]) -> Dict[str, Dict[str, float]]:
    """{tag: {"mean", "n"}} over the (tag, score) pairs whose tag is set and score finite, tags in name order."""
    grouped: Dict[str, List[float]] = {}
    for tag, score in zip(tags, scores, strict=True):
        if tag is not None and math.isfinite(score):
            grouped.setdefault(str(tag), []).append(float(score))
    return {tag: {"mean": sum(v) / len(v), "n": len(v)} for tag, v in sorted(grouped.items())}


def history_series(logged: Iterable[Tuple[int, Mapping[str, float]]]) -> History:
    """[(step, {key: value})] as the logger saw them -> {key: [(step, value)]}, steps ascending."""
    by_key: Dict[str, Dict[int, float]] = {}
    for step, values in logged:
        for key, value in values.items():
            by_key.setdefault(key, {})[int(step)] = float(value)
    return {key: sorted(points.items()) for key, points in sorted(by_key.items())}


def earlier_history(directory: Path, through_step: int) -> List[Tuple[int, Dict[str, float]]]:
    """The bundle's history up to `through_step`, as logged entries (none when unreadable)."""
    try:
        saved = json.loads((Path(directory) / "history.json").read_text())
    except (OSError, ValueError):
        return []
    return [(s, {k: math.nan if v is None else v}) for k, pts in saved.items() for s, v in pts if s <= through_step]


def json_safe(value: Any) -> Any:
    """Non-finite floats as None (strict JSON), tuples as lists, throughout."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def mean(values: Sequence[float]) -> Optional[float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def headline(metrics: Mapping[str, float], before_after: Optional[Mapping[str, Any]]) -> Dict[str, Optional[float]]:
    figures: Dict[str, Optional[float]] = {}
    if before_after:
        before, after = mean(before_after.get("before", [])), mean(before_after.get("after", []))
        figures["held-out reward before training"] = before
        figures["held-out reward after training"] = after
        figures["gain"] = None if before is None or after is None else after - before
        figures["steps"] = before_after.get("steps")
    return {**figures, **{key: value for key, value in sorted(metrics.items())}}


# ---------------------------------------------------------------- images of an evaluation
@dataclass
class EvaluationRecord:
    """What the bundle keeps of an evaluation: each image's (category tag, score) and a few
    images with their captions."""

    tags: List[Optional[str]] = field(default_factory=list)
    scores: List[float] = field(default_factory=list)
    images: List[Tuple[Any, str]] = field(default_factory=list)  # (PIL image, caption)


def to_pil(image):
    """(3, H, W) in [0, 1], or a clip (F, 3, H, W) (its middle frame), as a PIL image no
    larger than the page shows (kept between evaluations: small, whatever the resolution)."""
    from PIL import Image

    if image.ndim == 4:
        image = image[image.shape[0] // 2]
    pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().byte()
    picture = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    picture.thumbnail((report.THUMBNAIL, report.THUMBNAIL))
    return picture


def record_evaluation(prompts: Sequence[str], images, scores, per_prompt: int, limit: int = REPORT_IMAGES):
    """An evaluation's images (B, 3, H, W) or clips, and their scores (NaN: not scored), of
    `prompts` each repeated `per_prompt` times in a row -> an EvaluationRecord whose images
    are the first `limit` of the prompts' first seeds."""
    scores = [float(s) for s in scores]
    record = EvaluationRecord([category(p) for p in prompts], scores)
    for index in range(0, len(prompts), per_prompt)[:limit]:
        score = f"{scores[index]:.4g}" if math.isfinite(scores[index]) else "not scored"
        record.images.append((to_pil(images[index]), f"{prompts[index]} (reward {score})"))
    return record


# ---------------------------------------------------------------- what a run used
def data_files(cfg) -> Dict[str, Path]:
    """The files of a run's prompt sets ({"train", "eval"}: the evaluation's source, eval.prompts
    or data.eval, when it is not the training set), and its preference pairs ("pairs") when
    they are one file (a folder or glob of shards is not hashed)."""
    data = cfg.data
    files = {"train": resolve_prompt_file(data.train, "data.train")}
    spec, key = prompt_source(cfg)
    if key != "data.train":
        files["eval"] = resolve_prompt_file(spec, key)
    if data.pairs and Path(data.pairs).expanduser().is_file():
        files["pairs"] = Path(data.pairs).expanduser()
    return files


def hydra_overrides() -> List[str]:
    """The command line's overrides of the running Hydra application (none outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


# ---------------------------------------------------------------- the bundle
def write_results(
    directory: Path,
    *,
    config: Any,
    metrics: Mapping[str, float],
    per_category: Mapping[str, Mapping[str, float]],
    history: Iterable[Tuple[int, Mapping[str, float]]],
    images: Sequence[Tuple[Any, str]],
    checkpoint_files: Sequence[Path],
    prompt_files: Mapping[str, Path],
    overrides: Sequence[str],
    made_by: str,
    replaces: Iterable[str] = (),
    before_after: Optional[Mapping[str, Any]] = None,
    start_step: int = 0,
    command: Optional[Sequence[str]] = None,
    title: str = "Training run results",
) -> Path:
    """Write the bundle to `directory` (refused, ResultsNotOurs, over one it did not make;
    see the module docstring). `config`: YAML text or a (structured) config; `history`: the
    (step, metrics) entries as logged; `images`: (PIL image, caption); `made_by`: the
    checkpoint the bundle describes; `before_after`: eval.json's content. Replacing its
    own bundle, the entries of the old history up to `start_step` come first."""
    directory = Path(directory)
    logged = list(history)
    if check_replaceable(directory, replaces) and start_step > 0:
        logged = earlier_history(directory, start_step) + logged
    series = history_series(logged)
    text = config if isinstance(config, str) else OmegaConf.to_yaml(OmegaConf.structured(config))
    run_dir = directory.parent
    contents = {
        "config.yaml": text,
        "manifest.json": manifest(
            run_dir, checkpoint_files, prompt_files, overrides, made_by, sys.argv if command is None else command
        ),
        "metrics.json": {"final": dict(metrics), "per_category": dict(per_category), **dict(before_after or {})},
        "history.json": {key: [[s, v] for s, v in points] for key, points in series.items()},
        "report.html": report.render(title, headline(metrics, before_after), per_category, series, images),
    }

    def write(tmp: Path) -> None:
        for name, content in contents.items():
            text = content if isinstance(content, str) else json.dumps(json_safe(content), indent=2, allow_nan=False)
            (tmp / name).write_text(text)

    return write_directory(directory, write)
