"""Qwen-Image-Edit-Plus (2509) as a model family: Qwen-Image's transformer, VAE, schedule and
true CFG (`omni.models.qwen_image`), conditioned on an instruction and one to three source
images (`omni.data.edits`), as `QwenImageEditPlusPipeline.__call__` does.

For each source image the pipeline keeps its aspect ratio and resizes it twice, to fixed
areas (its `CONDITION_IMAGE_SIZE`, 384x384, and `VAE_IMAGE_SIZE`, 1024x1024, sides rounded to
multiples of 32), whatever the output resolution:
- the condition-size copies go to the Qwen2.5-VL text encoder with the instruction: the edit
  chat template holds "Picture N: <|vision_start|><|image_pad|><|vision_end|>" per source
  before the instruction, the processor (`Qwen2VLProcessor`) expands each `<|image_pad|>` to
  the vision tower's tokens, and the last hidden states after the template's system part are
  kept, nothing cut (the pipeline does not truncate to `max_sequence_length`); the negative
  prompt " " of true CFG is encoded with the same images;
- the VAE-size copies are encoded by the VAE (the posterior's mode, normalised per channel),
  packed into 2x2-patch tokens like the noise, and concatenated after the noise tokens at every
  transformer pass; `img_shapes` lists the output's token grid then each source's, and the
  velocity is the output's first (noise) tokens.

The pipeline takes one prompt per call. We batch prompts whose sources have the same grids
into one transformer pass (their text cut to the batch's longest with a mask, as Qwen-Image
does) and run prompts with other grids apart, so a batch gives each prompt the pipeline's
velocity. Conditioning rows of other batches stack: `QwenEditConditioning.cat` pads the text,
the source tokens and the grid list to the longest (zero mask, zero grids are padding).

The tiny pipeline is the tiny Qwen-Image's parts (its tokenizer with the edit template's words
as single tokens, so the pipeline's fixed 64-token drop removes exactly the system part; its
Qwen2.5-VL whose one-block vision tower now sees the images) plus a Qwen2VLImageProcessor with
Qwen2.5-VL's published settings. transformers builds `Qwen2VLProcessor` only with its video
processor, which needs torchvision; the pipeline passes images only, so the tiny checkpoint
saves `ImageQwen2VLProcessor` (this module's, the same processor without the video part). A
real checkpoint names `Qwen2VLProcessor` and loads where torchvision is installed.

`rollout.options.backend=native` runs vLLM-Omni's own QwenImageEditPlusPipeline
(`QwenImageEditPlusNative`): it sizes, encodes and conditions on the sources as above.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from omni.atomic import write_directory
from omni.data.edits import open_sources
from omni.models.base import Conditioning
from omni.models.packing import pack
from omni.models.qwen_image import (
    NEGATIVE_PROMPT,
    SCHEDULER,
    TINY_TRANSFORMER,
    QwenImageFamily,
    QwenImageNative,
    pad_to,
    qwen_text_encoder,
    qwen_tokenizer,
    qwen_vae,
    trim,
)
from omni.models.tiny_parts import cached_checkpoint

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 2

# The words and punctuation pieces of QwenImageEditPlusPipeline's chat template, each one token
# of the tiny tokenizer: its system part is then 64 tokens, the count the pipeline drops.
EDIT_TEMPLATE_WORDS = (
    "system Describe the key features of input image color shape size texture objects background then "
    "explain how user text instruction should alter or modify Generate a new that meets requirements "
    "while maintaining consistency with original where appropriate assistant Picture ( ), 's"
).split()
# Qwen2.5-VL's published preprocessor settings (14-pixel patches merged 2x2, CLIP's statistics).
IMAGE_PROCESSOR = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
# The pipeline's sources: VAE latents at 1024x1024 are (1024 / 16)^2 packed tokens each, and
# the condition copy at 384x384 (392 after the processor's rounding to 28) 14^2 text tokens.
SOURCE_TOKENS = (1024 // 16) ** 2
CONDITION_TOKENS = (392 // 28) ** 2


_PROCESSOR_CLASS = None


def __getattr__(name: str):
    """`ImageQwen2VLProcessor`, made on first use, so importing the family imports no
    transformers. diffusers loads a tiny checkpoint's processor by this module and class name,
    and finds its loading method by the base class of that name here (`ProcessorMixin`)."""
    global _PROCESSOR_CLASS
    if name not in ("ImageQwen2VLProcessor", "ProcessorMixin"):
        raise AttributeError(name)
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if name == "ProcessorMixin":
        return ProcessorMixin
    if _PROCESSOR_CLASS is None:

        class ImageQwen2VLProcessor(Qwen2VLProcessor):
            """Qwen2VLProcessor without its video processor (text and images only)."""

            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
                self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        ImageQwen2VLProcessor.__qualname__ = "ImageQwen2VLProcessor"
        _PROCESSOR_CLASS = ImageQwen2VLProcessor
    return _PROCESSOR_CLASS


# ----------------------------------------------------------------- tiny pipeline
def build_tiny_qwen_image_edit_plus_pipeline(seed: int = 0):
    """A complete random Qwen-Image-Edit-Plus pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    from transformers import Qwen2VLImageProcessor

    tokenizer = qwen_tokenizer(EDIT_TEMPLATE_WORDS)
    processor = __getattr__("ImageQwen2VLProcessor")(Qwen2VLImageProcessor(**IMAGE_PROCESSOR), tokenizer)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER)
    return QwenImageEditPlusPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=qwen_vae(seed + 1),
        text_encoder=qwen_text_encoder(tokenizer, seed + 2),
        tokenizer=tokenizer,
        processor=processor,
    )


def tiny_qwen_image_edit_plus_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir,
        "qwen-image-edit-plus-tiny",
        TINY_BUILDER_VERSION,
        seed,
        lambda path: write_directory(Path(path), lambda tmp: _save_tiny(seed, tmp)),
    )


def _save_tiny(seed: int, directory: Path) -> None:
    """The tiny pipeline, and beside its processor the video-processor settings a published
    checkpoint's processor folder has: vLLM-Omni loads it as a full `Qwen2VLProcessor`."""
    build_tiny_qwen_image_edit_plus_pipeline(seed).save_pretrained(directory, safe_serialization=True)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", **IMAGE_PROCESSOR}
    (directory / "processor" / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


# ----------------------------------------------------------------- conditioning
@dataclass
class QwenEditConditioning(Conditioning):
    """Per prompt: the instruction's hidden states (with its sources' vision tokens) and mask,
    the sources' packed VAE tokens one after the other, each source's token grid (h, w), and
    under true CFG the negative prompt's hidden states and mask. Zero-padded along dim 1."""

    embeds: torch.Tensor
    mask: torch.Tensor
    sources: torch.Tensor
    source_grids: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_mask: Optional[torch.Tensor] = None

    @classmethod
    def cat(cls, parts: Sequence["QwenEditConditioning"]) -> "QwenEditConditioning":
        """The rows of several batches, each field zero-padded to the longest along dim 1."""

        def padded(tensors):
            longest = max(t.shape[1] for t in tensors)
            return torch.cat([F.pad(t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1])) for t in tensors])

        per_field = ([getattr(p, name) for p in parts] for name in cls.field_names())
        return cls(*(None if tensors[0] is None else padded(tensors) for tensors in per_field))


def encode_sources(pipe, images, device):
    """The pipeline's two copies of each source: condition-size PIL images for the text
    encoder, and the VAE-size copies' packed latents (1, tokens, 64) with their grids."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        VAE_IMAGE_SIZE,
        calculate_dimensions,
    )

    conditions, latents, grids = [], [], []
    for image in images:
        ratio = image.width / image.height
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)
        conditions.append(pipe.image_processor.resize(image, height, width))
        width, height = calculate_dimensions(VAE_IMAGE_SIZE, ratio)
        pixels = pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
        encoded = pipe._encode_vae_image(pixels.to(device, pipe.vae.dtype), generator=None)
        latents.append(pack(encoded[:, :, 0].float()))
        grids.append((height // pipe.vae_scale_factor // 2, width // pipe.vae_scale_factor // 2))
    return conditions, torch.cat(latents, 1), torch.tensor([grids], dtype=torch.long, device=latents[0].device)


def encode_edit(pipe, prompt: str, negative: bool, device) -> QwenEditConditioning:
    """One edit prompt's conditioning (its sources opened, or an error naming its origin)."""
    images = open_sources(prompt)
    if len(images) > FAMILY.max_source_images:
        where = getattr(prompt, "origin", "") or repr(str(prompt)[:60])
        raise ValueError(f"{where}: Qwen-Image-Edit-Plus takes at most {FAMILY.max_source_images} source images")
    conditions, sources, grids = encode_sources(pipe, images, device)

    def encoded(text):  # the hidden states and a mask (the pipeline's is None when all are real)
        # on the pipeline's own device: vLLM-Omni's pipeline (the native backend) takes no `device`
        embeds, mask = pipe.encode_prompt(prompt=text, image=conditions)
        return pad_to(embeds, mask, embeds.shape[1])

    embeds, mask = encoded([str(prompt)])
    neg_embeds, neg_mask = encoded(NEGATIVE_PROMPT) if negative else (None, None)
    return QwenEditConditioning(embeds, mask, sources, grids, neg_embeds, neg_mask)


def edit_velocity(transformer, latents, timestep, embeds, mask, sources, grids) -> torch.Tensor:
    """The transformer's velocity on the noise tokens with each row's source tokens after
    them; rows with the same source grids run as one batch, others apart."""
    side = math.isqrt(latents.shape[1])
    groups: dict = {}
    # integers again: a worker casts every conditioning tensor to the transformer's dtype
    for row, row_grids in enumerate(grids.round().long().tolist()):
        groups.setdefault(tuple((h, w) for h, w in row_grids if h), []).append(row)
    parts, order = [], []
    for key, rows in groups.items():
        index = torch.tensor(rows, device=latents.device)
        count = sum(h * w for h, w in key)
        text, text_mask = trim(embeds[index], mask[index])
        hidden = torch.cat([latents[index], sources[index, :count].to(latents.dtype)], 1)
        out = transformer(
            hidden_states=hidden,
            timestep=timestep[index],
            encoder_hidden_states=text,
            encoder_hidden_states_mask=text_mask,
            img_shapes=[[(1, side, side), *((1, h, w) for h, w in key)]] * len(rows),
            return_dict=False,
        )[0]
        parts.append(out[:, : latents.shape[1]].float())
        order += rows
    return torch.cat(parts)[torch.argsort(torch.tensor(order, device=latents.device))]


class QwenImageEditPlusNative(QwenImageNative):
    """vLLM-Omni's QwenImageEditPlusPipeline under `rollout.options.backend=native`: Qwen-Image's
    facts (true CFG on " " with norm rescale, fused and renamed projections, the timestep), and
    the sources, which each request carries (`multi_modal_data`): vLLM-Omni's pre-process sizes
    them to the pipeline's two fixed areas as `encode_sources` does, its text encoder sees the
    condition-size copies, its VAE the others. It samples one request per `forward` (no
    `supports_request_batch`: the engine starts it with `max_num_seqs` 1) and post-processes an
    image tensor only. The conditioning is what its loop was given: the embeddings and masks as
    long as the prompt is (its vision tokens included, as the family keeps them), the packed
    source tokens (`image_latents`) and their grids (`img_shapes` after the output's)."""

    pipeline = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus.QwenImageEditPlusPipeline"
    cond_arguments = (
        "prompt_embeds",
        "prompt_embeds_mask",
        "negative_prompt_embeds",
        "negative_prompt_embeds_mask",
        "image_latents",
        "img_shapes",
    )
    post_process = "takes_tensor"  # its post-process takes an image tensor only

    def conditioning(self, family, given, max_sequence_length: int):
        embeds, mask, neg, neg_mask, sources, shapes = given.values()
        grids = torch.tensor([[(h, w) for _, h, w in row[1:]] for row in shapes], dtype=torch.long)
        negatives = pad_to(neg, neg_mask, neg.shape[1]) if neg is not None else (None, None)
        return family.conditioning(*pad_to(embeds, mask, embeds.shape[1]), sources.float(), grids, *negatives)

    def encode_prompts(self, pipe, prompts, guidance_scale: float, max_sequence_length: int):
        """The family's own encoding, run on vLLM-Omni's encoders and VAE (each prompt's sources read)."""
        cond = pipe.family.encode_prompts(pipe, prompts, guidance_scale, max_sequence_length, pipe.device)
        return cond.apply(lambda t: t.cpu())


class QwenImageEditPlusFamily(QwenImageFamily):
    name = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    conditioning = QwenEditConditioning
    edit = True
    max_source_images = 3  # the pipeline's documented range, and what 2509 was trained on
    native = QwenImageEditPlusNative()
    # Qwen-Image-Edit-2509's transformer is Qwen-Image's architecture (the same config).
    published_configs = {"qwen-image-edit-2509": "qwen-image-transformer.json"}

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_qwen_image_edit_plus_path(cache_dir, seed)

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        """The output's tokens, the prompt's, and for the most sources their VAE tokens and
        vision tokens (the pipeline's fixed sizes, whatever the output resolution)."""
        per_source = SOURCE_TOKENS + CONDITION_TOKENS
        return (resolution // 16) ** 2 + max_sequence_length + self.max_source_images * per_source

    def pipeline_sources(self, prompts, resolution: int) -> dict:
        """The pipeline's `image` (a list of PIL images): it takes one prompt per call, and
        sizes its output by `height` and `width` alone."""
        if len(prompts) != 1:
            raise ValueError(f"{self.pipeline_class} takes one prompt (and its sources) per call, not {len(prompts)}")
        return {"image": open_sources(prompts[0])}

    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> QwenEditConditioning:
        """Each prompt encoded with its own sources, as the pipeline encodes one prompt (no
        truncation to `max_sequence_length`, which the pipeline only bounds by 1024)."""
        with torch.no_grad():
            rows = [encode_edit(pipe, p, guidance_scale > 1, device) for p in prompts]
        return QwenEditConditioning.cat(rows)

    def velocity_pass(self, transformer, latents, sigmas, cond: QwenEditConditioning, negative: bool = False):
        timestep = sigmas.float() * 1000 / 1000  # as Qwen-Image's: the scheduler's timestep over 1000
        embeds, mask = (cond.neg_embeds, cond.neg_mask) if negative else (cond.embeds, cond.mask)
        return edit_velocity(transformer, latents, timestep, embeds, mask, cond.sources, cond.source_grids)


FAMILY = QwenImageEditPlusFamily()
