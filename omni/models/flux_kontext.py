"""FLUX.1 Kontext as an edit model family: FLUX.1's transformer, text conditioning, noise,
schedule and guidance embedding (`omni.models.flux`), conditioned also on the edit's source
image, whose VAE latents ride beside the noisy latents as extra image tokens.

Sampling follows `FluxKontextPipeline.__call__` with one source image and `_auto_resize=False`:
- the source is used at its own size rounded down to a multiple of the VAE's factor times 2
  (the pipeline's `image_processor.resize` then `preprocess`, to [-1, 1]); with `_auto_resize`
  True (the pipeline's default) it would first be resized to the nearest of Kontext's preferred
  resolutions, which we do not do: a rollout conditions on the source as the data gives it;
- it is encoded by the VAE's posterior mode, shifted and scaled as the latents are (the
  pipeline's `_encode_vae_image`), and packed into 2x2 tokens like the latents;
- its tokens' positions are the latents' (0, row, column) with the first coordinate 1, so the
  transformer tells the reference from the image being made;
- every step the transformer gets cat([latents, reference tokens]) and cat of their positions,
  and the velocity is its output at the latents' own tokens;
- the noise schedule's shift counts the latents' tokens only, as the pipeline's does.
FLUX.1 Kontext [dev] is guidance-distilled like FLUX.1-dev (an embedding, 2.5 by default in
the pipeline, one pass). The pipeline's true classifier-free guidance (`true_cfg_scale` with a
negative prompt, a second pass) is not offered here. The sources of one batch must share a
size (their tokens are batched together): validation refuses a set whose sources differ in
size (`sources_problem`), before any model loads.

The tiny pipeline is the tiny FLUX.1 one (`omni.models.flux`) assembled as a
FluxKontextPipeline: the transformer class is the same, and FLUX.1-Kontext-dev's transformer
has FLUX.1-dev's published architecture (its memory estimate reuses that config).
vLLM-Omni serves it through its own FluxKontextPipeline (`rollout.options.backend=native`,
`FluxKontextNative`), not through our diffusers pipeline inside it (`vllm_served` False).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from omni.data.edits import open_sources
from omni.data.prompts import source_images
from omni.models.base import vae_encode
from omni.models.flux import FluxFamily, FluxNative, FluxPromptEmbeds, build_tiny_flux_pipeline, image_ids
from omni.models.packing import pack, unpack
from omni.models.tiny_parts import cached_checkpoint, save_pipeline

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 1
# The first position coordinate of the reference tokens (the latents' is 0).
REFERENCE_INDEX = 1


def _image_size(path: str) -> Optional[Tuple[int, int]]:
    """An image's (width, height) from its header; None if unreadable."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, ValueError):
        return None


def build_tiny_flux_kontext_pipeline(seed: int = 0):
    """The tiny FLUX.1-dev pipeline's components (guidance embedding, dev's scheduler, as
    FLUX.1 Kontext [dev] ships them) as a FluxKontextPipeline; identical for identical seeds."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**build_tiny_flux_pipeline(seed).components)


def tiny_flux_kontext_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir,
        "flux-kontext-tiny",
        TINY_BUILDER_VERSION,
        seed,
        lambda path: save_pipeline(build_tiny_flux_kontext_pipeline(seed), path),
    )


def reference_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """Positions (1, row, column) of a packed reference of height x width tokens."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.stack([torch.full_like(rows, REFERENCE_INDEX), rows, cols], dim=-1).reshape(height * width, 3)
    return ids.to(device=device, dtype=dtype)


@dataclass
class FluxKontextConditioning(FluxPromptEmbeds):
    """FLUX's text conditioning and the source image's VAE latents (transformer scale),
    unpacked, (B, C, h, w), C the VAE's latent channels (16 for FLUX's VAE, 4 for
    `model=micro_kontext`'s): the shape keeps a non-square source's token grid, from which
    the reference tokens' positions follow; they are packed when the transformer runs."""

    source: torch.Tensor


class FluxKontextNative(FluxNative):
    """vLLM-Omni's FluxKontextPipeline under `rollout.options.backend=native`: FLUX's facts,
    and the source, which each request carries (`multi_modal_data`) and vLLM-Omni's pipeline
    sizes, encodes and packs as `FluxKontextFamily` does (its own size rounded down, posterior
    mode, reference ids with first coordinate 1, the schedule's shift on the latents' tokens).
    It samples one request per `forward` (no `supports_request_batch`: the engine starts it
    with `max_num_seqs` 1).
    The conditioning's source is the packed `image_latents` its loop was given, unpacked on
    the grid of the reference ids (a non-square source keeps its shape)."""

    pipeline = "vllm_omni.diffusion.models.flux.pipeline_flux_kontext.FluxKontextPipeline"
    # its loop steps the scheduler itself: no `prepare_timesteps`
    hooks = ("diffuse", "forward", "scheduler_step", "load_weights", "encode_prompt")
    cond_arguments = ("prompt_embeds", "pooled_prompt_embeds", "image_latents", "latent_ids")
    post_process = "takes_tensor"  # its post-process takes an image tensor only

    def forward_arguments(self, options) -> dict:
        """Its forward pads the text to its argument's length (512 by default), not the request's."""
        return {"max_sequence_length": options.max_sequence_length}

    def conditioning(self, family, given, max_sequence_length: int):
        ids = given["latent_ids"]
        reference = ids[ids[:, 0] == REFERENCE_INDEX]
        grid = (int(reference[:, 1].max()) + 1, int(reference[:, 2].max()) + 1)
        source = unpack(given["image_latents"], grid).float()
        return family.conditioning(given["prompt_embeds"], given["pooled_prompt_embeds"], source)

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts, guidance_scale: float, max_sequence_length: int):
        """FLUX's text embeddings from vLLM-Omni's encoders, and the sources' latents from its VAE."""
        text = super().encode_prompts(pipe, prompts, guidance_scale, max_sequence_length)
        sources = pipe.family.encode_sources(pipe, prompts, "cpu")
        return pipe.family.conditioning(text.embeds, text.pooled, sources)


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    conditioning = FluxKontextConditioning
    edit = True
    max_source_images = 1
    vllm_served = False
    native = FluxKontextNative()
    # FLUX.1-Kontext-dev's transformer/config.json has FLUX.1-dev's architecture.
    published_configs = {"flux.1-kontext-dev": "flux.1-dev-transformer.json"}

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_flux_kontext_path(cache_dir, seed)

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        """The image's tokens, as many reference tokens for a source of the same size, and the text."""
        return 2 * (resolution // 16) ** 2 + max_sequence_length

    def pipeline_sources(self, prompts, resolution: int) -> dict:
        """The source images at their own size (`_auto_resize=False`) and the output's area:
        FluxKontextPipeline resizes its output to `max_area` (1024^2 by default) whatever
        `height` and `width` say."""
        images = [self._source(prompt) for prompt in prompts]
        return {"image": images, "_auto_resize": False, "max_area": resolution * resolution}

    def sources_problem(self, prompts) -> Optional[str]:
        """Sources of more than one size: a batch's reference tokens are stacked, so they must
        share a grid (one size keeps that whatever the VAE's factor). Reads headers only."""
        first = None
        for prompt in prompts:
            for path in source_images(prompt):
                size = _image_size(path)
                if size is None:
                    continue  # unreadable: the rollout names it with its prompt
                if first is None:
                    first = (size, prompt.origin or path)
                elif size != first[0]:
                    (w0, h0), where = first
                    return (
                        f"model.family={self.name} batches sources of one size, but {where} has a source of "
                        f"{w0}x{h0} pixels and {prompt.origin or path} one of {size[0]}x{size[1]}: resize the "
                        "sources to one size, or use model=qwen_image_edit_plus, which sizes every source to one area"
                    )
        return None

    def _source(self, prompt):
        sources = open_sources(prompt)
        if len(sources) > self.max_source_images:
            where = getattr(prompt, "origin", "") or repr(str(prompt)[:60])
            raise ValueError(f"{where}: FLUX.1 Kontext edits one source image, this prompt has {len(sources)}")
        return sources[0]

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> FluxKontextConditioning:
        """FLUX's text embeddings and each prompt's source latents; the sources are read first,
        so a prompt without one fails (naming its origin) before any encoder runs."""
        sources = self.encode_sources(pipe, prompts, device)
        text = super().encode_prompts(pipe, prompts, guidance_scale, max_sequence_length, device)
        return FluxKontextConditioning(text.embeds, text.pooled, sources)

    def encode_sources(self, pipe, prompts, device) -> torch.Tensor:
        """Each prompt's source latents, (B, C, h, w) on `device`; sources of one batch share a size."""
        latents = [self.encode_source(pipe, self._source(prompt), device) for prompt in prompts]
        if len({tuple(s.shape) for s in latents}) > 1:
            sizes = ", ".join(
                f"{getattr(p, 'origin', '') or str(p)[:40]}: {tuple(s.shape[-2:])}" for p, s in zip(prompts, latents)
            )
            raise ValueError(f"FLUX.1 Kontext batches sources of one size only; latent sizes {sizes}")
        return torch.cat(latents).to(device)

    def encode_source(self, pipe, image, device) -> torch.Tensor:
        """One PIL source -> its VAE latents (1, C, h, w), fp32 on the CPU, as the pipeline
        preprocesses and encodes it without auto-resizing."""
        multiple = pipe.vae_scale_factor * 2
        height, width = (side // multiple * multiple for side in pipe.image_processor.get_default_height_width(image))
        image = pipe.image_processor.resize(image, height, width)
        pixels = pipe.image_processor.preprocess(image, height, width)  # in [-1, 1]
        return vae_encode(pipe.vae, (pixels + 1) / 2, device)

    def image_tokens(self, latents: torch.Tensor, cond: FluxKontextConditioning):
        """The latents followed by the packed source tokens; positions likewise."""
        height, width = (side // 2 for side in cond.source.shape[-2:])
        tokens = torch.cat([latents, pack(cond.source).to(latents.dtype)], dim=1)
        ids = torch.cat(
            [
                image_ids(latents.shape[1], latents.device, latents.dtype),
                reference_ids(height, width, latents.device, latents.dtype),
            ]
        )
        return tokens, ids


FAMILY = FluxKontextFamily()
