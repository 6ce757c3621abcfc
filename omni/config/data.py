"""Schema of the `data` group: prompt sets (text, JSONL or CSV; see omni.data.prompts) and
preference pairs (JSONL, parquet, a `datasets` directory, or Pick-a-Pic's layout)."""

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class DataConfig:
    # A path, or `omni:<name>` for a prompt set shipped with the package. Mandatory: the
    # data group's options name one; data=prompts (the published-run presets) leaves it to you.
    # A `hint` says, when the value is missing, what to pass (omni.validation).
    train: str = field(
        default=MISSING,
        metadata={
            "hint": "pass data.train=/path/to/prompts.txt (one prompt a line; JSONL or CSV also read) "
            "or data.train=omni:<name> for a set shipped with the package (e.g. omni:colors_train)"
        },
    )
    # Held-out prompts for evaluation; None: the train prompts.
    eval: Optional[str] = None
    # Preference pairs for offline DPO: a JSONL or parquet file, a folder or glob of them
    # (shards), or a `datasets` save_to_disk directory; read lazily, never all in memory.
    pairs: Optional[str] = field(
        default=None,
        metadata={"hint": "pass data.pairs=/path/to/pairs.jsonl (or parquet shards, a glob, a datasets directory)"},
    )
    # Processes decoding the pairs' images (0: in the driver, between steps).
    num_workers: int = 0
    # A directory of VAE latents and text embeddings of the pairs, built once (on the first
    # run, or by scripts/cache_latents.py) and memory-mapped after. "auto": when the images are
    # encoded by inverting the decoder (model.vae_inversion_steps > 0, the tiny models: 100
    # decoder passes an image), a directory under model.cache_dir named by the model and the
    # data, shared by the runs on them; otherwise, as null, each pair is encoded every time a
    # step or an evaluation uses it (a real VAE's encoder is one pass, and a real set's text
    # embeddings can take terabytes: name a directory to cache them).
    latent_cache: Optional[str] = "auto"
    # Skip (and count in the log) pairs with a bad row instead of stopping at the first.
    skip_bad_rows: bool = False
    # Share of the pairs held out to measure implicit accuracy (never trained on).
    pairs_eval_fraction: float = 0.2
    # Held-out pairs scored at each evaluation: the first this many of the held-out share
    # (a seeded choice, the same at every evaluation); None: all of them (at Pick-a-Pic's
    # size, 200,000 pairs an evaluation).
    pairs_eval_max: Optional[int] = 256
