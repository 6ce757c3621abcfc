"""Schema of the `data` group: prompt sets (a text file, one prompt a line) and
preference pairs (JSONL, parquet, a `datasets` directory, or Pick-a-Pic's layout)."""

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class DataConfig:
    # A path, or `omni:<name>` for a prompt set shipped with the package.
    train: str = MISSING
    # Held-out prompts for evaluation; None: the train prompts.
    eval: Optional[str] = None
    # Preference pairs for offline DPO.
    pairs: Optional[str] = None
    # Skip (and count in the log) pairs with a bad row instead of stopping at the first.
    skip_bad_rows: bool = False
    # Share of the pairs held out to measure implicit accuracy.
    pairs_eval_fraction: float = 0.2
