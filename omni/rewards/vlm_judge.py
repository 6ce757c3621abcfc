"""A vision-language model as the judge (`reward=vlm_judge`), behind an OpenAI-compatible chat
API such as vLLM or SGLang serve for Qwen2.5-VL or UnifiedReward.

Each image is one chat request (`concurrency` at a time): the image as a PNG data URL and
`question`, with `{prompt}` replaced by the image's prompt; an edit's request sends its source
image(s) first, then the result, with `edit_question`. The score is the first group of
`score_pattern` found in the answer, divided by `scale` (0-10 -> 0-1 by default). An answer
with no score is counted and logged with its text and the image gets NaN, so
`reward.nonfinite` decides (stop, or leave it out with `drop`); it never becomes a 0.
Requests are retried as `omni.rewards.retrying` says; `setup` checks that the server serves
`model` (GET /models), before any diffusion model loads. Needs the `reward-http` extra.

    python recipes/train.py reward=vlm_judge reward.components.vlm_judge.url=http://judge:8000/v1 \\
        reward.components.vlm_judge.model=Qwen/Qwen2.5-VL-7B-Instruct reward.nonfinite=drop
"""

from __future__ import annotations

import logging
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import MISSING
from PIL import Image

from omni.data.prompts import source_images
from omni.rewards.base import Reward
from omni.rewards.protocol import encode_image, file_base64
from omni.rewards.retrying import RemoteOptions, RetryingClient, check_remote_options, served_by

logger = logging.getLogger(__name__)


def mime_type(path: str) -> str:
    """The image's MIME type from its content (files of an edit set may have any name)."""
    with Image.open(path) as image:
        return Image.MIME.get(image.format, "image/png")


@dataclass
class VlmJudgeOptions(RemoteOptions):
    # url: the API's base URL, ending in /v1 (routes /models and /chat/completions).
    # The served model's name, as the API lists it.
    model: str = MISSING
    # The question asked with each image; {prompt} becomes the image's prompt.
    question: str = (
        'Rate from 0 to 10 how well this image matches the description "{prompt}". Answer with the number only.'
    )
    # The question for an edit (a prompt with source images, sent before the result);
    # {prompt} becomes the instruction.
    edit_question: str = (
        'The first image(s) are the source; the last is the result of the edit "{prompt}". Rate from 0 to 10 how '
        "well the result carries out the edit while keeping everything else of the source. Answer with the number only."
    )
    # A regular expression whose first group is the score in the answer.
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    # The score is the parsed number divided by this.
    scale: float = 10.0
    max_tokens: int = 32
    temperature: float = 0.0
    # Name of an environment variable holding the API key (sent as a bearer token); None: no key.
    api_key_env: Optional[str] = None
    # Images judged at once (one request each).
    concurrency: int = 8


def answer_text(body: Any) -> str:
    """The assistant's text in a chat completion; ValueError when the body is not one."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a chat completion: {str(body)[:200]}") from None
    if not isinstance(content, str):
        raise ValueError(f"the answer's content is not text: {str(content)[:200]}")
    return content


class VlmJudge(Reward):
    Options = VlmJudgeOptions

    @classmethod
    def check_options(cls, options: VlmJudgeOptions, key: str) -> None:
        check_remote_options(options, key)
        try:
            options.question.format(prompt="")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"{key}.question: only {{prompt}} may be a placeholder ({error!r}); write {{{{ }}}} for a brace"
            ) from None
        try:
            groups = re.compile(options.score_pattern).groups
        except re.error as error:
            raise ValueError(f"{key}.score_pattern={options.score_pattern}: {error}") from None
        if groups < 1:
            raise ValueError(f"{key}.score_pattern={options.score_pattern}: needs a group (...) around the score")
        if options.scale == 0 or options.concurrency < 1 or options.max_tokens < 1:
            raise ValueError(f"{key}: scale must not be 0, concurrency and max_tokens must be >= 1")
        if options.api_key_env and not os.environ.get(options.api_key_env):
            raise ValueError(f"{key}.api_key_env={options.api_key_env}: that environment variable is not set")

    def source(self) -> str:
        return served_by(self.options)

    def setup(self) -> None:
        options, key = self.options, f"reward.components.{self.name}"
        headers = {"Authorization": f"Bearer {os.environ[options.api_key_env]}"} if options.api_key_env else None
        self.client = RetryingClient(self.name, options, key, headers)
        self.pattern = re.compile(options.score_pattern)
        self.unparseable = 0  # answers without a score, over the run
        served = self.client.request("GET", "/models", lambda body: [m["id"] for m in body["data"]])
        if options.model not in served:
            self.teardown()
            raise ValueError(f"{key}.model={options.model}: {options.url} serves {served}")

    def teardown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None

    def chat_request(self, image: torch.Tensor, prompt: str) -> Dict[str, Any]:
        sources = source_images(prompt)
        question = (self.options.edit_question if sources else self.options.question).format(prompt=str(prompt))
        urls = [f"data:{mime_type(path)};base64,{file_base64(path)}" for path in sources]
        urls.append(f"data:image/png;base64,{encode_image(image)}")
        content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        content.append({"type": "text", "text": question})
        return {
            "model": self.options.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.options.max_tokens,
            "temperature": self.options.temperature,
        }

    def judge(self, image: torch.Tensor, prompt: str) -> Tuple[float, Optional[str]]:
        """(score, None), or (NaN, the answer) when the answer holds no score."""
        answer = self.client.request("POST", "/chat/completions", answer_text, json=self.chat_request(image, prompt))
        match = self.pattern.search(answer)
        try:
            return float(match.group(1)) / self.options.scale, None
        except (AttributeError, TypeError, ValueError):  # no match, or a group that is not a number
            return math.nan, answer

    def score(self, images: torch.Tensor, prompts: List[str]) -> torch.Tensor:
        with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
            judged = list(pool.map(self.judge, images, prompts))
        failed = [answer for _, answer in judged if answer is not None]
        if failed:
            self.unparseable += len(failed)
            logger.warning(
                "reward '%s': %d of %d answers held no score (%d in this run; their images are non-finite, "
                "see reward.nonfinite); first: %r",
                self.name,
                len(failed),
                len(judged),
                self.unparseable,
                failed[0][:200],
            )
        return torch.tensor([score for score, _ in judged], dtype=torch.float32)


REWARD = VlmJudge
