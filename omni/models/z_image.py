"""Z-Image (Tongyi-MAI's single-stream DiT, Z-Image-Turbo) as a model family: a tiny random
checkpoint built offline, Qwen3's text conditioning, 4-D latents of the FLUX VAE, the
single-stream transformer's velocity with Z-Image's guidance, and LoRA export for
`ZImagePipeline.load_lora_weights`.

Sampling follows `ZImagePipeline.__call__`:
- a prompt is wrapped in the tokenizer's chat template (a user turn, then the assistant's
  header, thinking enabled), padded to `max_sequence_length`; the conditioning is the text
  encoder's second-to-last hidden states of the real tokens. The transformer takes one
  variable-length tensor per prompt, so we keep every row padded with a mask (rows encoded
  apart stack) and hand it each row's real tokens;
- latents are (B, 16, h, w) VAE latents (the transformer patchifies them itself, 2x2, as
  one-frame clips (C, 1, h, w) in a list);
- the noise levels are `linspace(1, 1/n, n)` shifted by the scheduler (Turbo's: a fixed shift
  of 3; a scheduler with dynamic shifting gets mu from the number of image tokens);
- the transformer takes t = 1 - sigma (the pipeline's (1000 - timestep) / 1000) and predicts
  the negative of the flow-matching velocity;
- guidance is classifier-free on the negative prompt "" whenever `guidance_scale` > 0, in
  Z-Image's form v = pos + s (pos - neg) (so s is the usual scale minus one; Turbo is
  distilled and samples with 0, one pass); the pipeline's optional CFG renormalisation and
  truncation stay at their defaults (off);
- latents are scaled and shifted by the VAE's `scaling_factor` / `shift_factor`.

The tiny pipeline has every part a real checkpoint has (ZImageTransformer2DModel with its
noise and context refiners, a Qwen3 text encoder with a byte-level BPE `Qwen2Tokenizer` and a
chat template, an AutoencoderKL, Turbo's scheduler config), built in memory from a seed and
loaded with `ZImagePipeline.from_pretrained` like a real checkpoint. No hub access.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from omni.models.base import Conditioning, ModelFamily, vae_decode, vae_encode

# Qwen-Image's written-out byte-level BPE tokenizer is Qwen's own tokenizer class; Z-Image's
# text encoder is Qwen3, which tokenizes the same way.
from omni.models.packing import shifted_sigmas
from omni.models.qwen_image import qwen_tokenizer
from omni.models.tiny_parts import TINY_VAE_FACTOR, autoencoder_kl, cached_checkpoint, save_pipeline

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 1

TINY_TEXT_WIDTH = 32
TINY_TRANSFORMER = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=64,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=TINY_TEXT_WIDTH,
    axes_dims=[8, 12, 12],  # sums to the head width, dim / n_heads
    axes_lens=[1536, 512, 512],
)
# Z-Image-Turbo's scheduler/scheduler_config.json.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# The FLUX.1 VAE's latent normalisation, which Z-Image's VAE shares.
VAE_SHIFT, VAE_SCALE = 0.1159, 0.3611
NEGATIVE_PROMPT = ""  # the pipeline's negative prompt when none is given
# Qwen3's chat template for what the pipeline renders: one user turn, the generation prompt,
# and (thinking disabled only) an empty thinking block.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def z_image_tokenizer():
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def qwen3_text_encoder(tokenizer, seed: int):
    """A 32-wide, two-layer Qwen3 (the pipeline reads its second-to-last hidden states)."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TINY_TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3Model(config)


def build_tiny_z_image_pipeline(seed: int = 0):
    """A complete random Z-Image pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = z_image_tokenizer()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(**TINY_TRANSFORMER)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=autoencoder_kl(seed + 1, TINY_TRANSFORMER["in_channels"], VAE_SHIFT, VAE_SCALE),
        text_encoder=qwen3_text_encoder(tokenizer, seed + 2),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def write_tiny_z_image(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny pipeline and save it to `out_dir` atomically (never half-written)."""
    return save_pipeline(build_tiny_z_image_pipeline(seed), out_dir)


def tiny_z_image_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir, "z-image-tiny", TINY_BUILDER_VERSION, seed, lambda path: write_tiny_z_image(path, seed)
    )


@dataclass
class ZImagePromptEmbeds(Conditioning):
    """Z-Image's text conditioning per prompt: hidden states padded to a fixed length and their
    mask (1 on real tokens), and the negative prompt's under guidance."""

    embeds: torch.Tensor
    mask: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_mask: Optional[torch.Tensor] = None


def padded(rows: List[torch.Tensor], length: int):
    """The pipeline's variable-length rows -> (B, length, D) embeddings and their mask."""
    embeds = torch.zeros(len(rows), length, rows[0].shape[-1], dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=rows[0].device)
    for i, row in enumerate(rows):
        embeds[i, : len(row)], mask[i, : len(row)] = row, 1
    return embeds, mask


def transformer_velocity(transformer, latents, sigmas, embeds, mask) -> torch.Tensor:
    """One batched pass: each latent as a one-frame clip, each prompt's real tokens; the
    transformer predicts minus the velocity at t = 1 - sigma."""
    timestep = (1000 - sigmas.float() * 1000) / 1000  # as the pipeline computes it from its timesteps
    out = transformer(
        list(latents.unsqueeze(2).unbind(0)),
        timestep,
        [row[m.bool()] for row, m in zip(embeds, mask)],
        return_dict=False,
    )[0]
    return -torch.stack([o.float() for o in out]).squeeze(2)


class ZImageFamily(ModelFamily):
    name = "z_image"
    pipeline_class = "ZImagePipeline"
    transformer_class = "ZImageTransformer2DModel"
    conditioning = ZImagePromptEmbeds
    # The image refiner, the text refiner, then the single-stream blocks.
    layer_prefixes = ("noise_refiner.", "context_refiner.", "layers.")
    # Every block's attention projections (image, text and joint blocks share the names).
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoders = ("text_encoder",)
    published_configs = {"z-image-turbo": "z-image-turbo-transformer.json"}
    # Qwen3-4B as the pipeline loads it (Qwen3Model, no LM head), counted from its published
    # config on the meta device; the FLUX.1 VAE (Z-Image ships the same autoencoder).
    text_encoder_params = 4_022_468_096
    vae_params = 83_819_683
    published_vae_config = "flux.1-vae.json"

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_z_image_path(cache_dir, seed)

    def tiny_transformer_config(self) -> dict:
        return dict(TINY_TRANSFORMER)

    def published_scheduler_config(self, transformer_config: dict) -> dict:
        return dict(SCHEDULER)

    def tiny_resolution_multiple(self) -> int:
        return TINY_VAE_FACTOR * TINY_TRANSFORMER["all_patch_size"][0]

    def resolution_multiple(self, path) -> int:
        """The VAE's downsampling times the transformer's patch (its `all_patch_size`)."""
        root = Path(path).expanduser()
        vae = json.loads((root / "vae" / "config.json").read_text())
        patch = json.loads((root / "transformer" / "config.json").read_text())["all_patch_size"][0]
        return 2 ** (len(vae["block_out_channels"]) - 1) * patch

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        """Image patches and prompt tokens, each padded to a multiple of 32 as the transformer pads them."""
        image = (resolution // (8 * transformer_config["all_patch_size"][0])) ** 2
        return -(-image // 32) * 32 + -(-max_sequence_length // 32) * 32

    def forward_passes(self, guidance_scale: float) -> int:
        return 2 if guidance_scale > 0 else 1

    def guide(self, text: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        return text + guidance_scale * (text - uncond)

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> ZImagePromptEmbeds:
        """The prompts' (and under guidance the negative prompt's) embeddings and masks, padded
        to `max_sequence_length`."""
        with torch.no_grad():
            rows, _ = pipe.encode_prompt(
                list(prompts), device=device, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
            )
            embeds, mask = padded(rows, max_sequence_length)
            neg_embeds = neg_mask = None
            if self.forward_passes(guidance_scale) == 2:
                neg, _ = pipe.encode_prompt(
                    [NEGATIVE_PROMPT], device=device, do_classifier_free_guidance=False,
                    max_sequence_length=max_sequence_length,
                )  # fmt: skip
                neg_embeds, neg_mask = (t.expand(len(prompts), *t.shape[1:]) for t in padded(neg, max_sequence_length))
        return ZImagePromptEmbeds(embeds, mask, neg_embeds, neg_mask)

    def sigmas(self, pipe, num_steps: int, resolution: int) -> torch.Tensor:
        """ZImagePipeline's schedule: FLUX's, linspace(1, 1/n, n) shifted for the image tokens, then 0."""
        return shifted_sigmas(pipe, num_steps, resolution)

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        channels, size = pipe.transformer.config.in_channels, 2 * (resolution // (pipe.vae_scale_factor * 2))
        return torch.stack([torch.randn(channels, size, size, generator=g) for g in generators])

    def velocity_pass(self, transformer, latents, sigmas, cond: ZImagePromptEmbeds, negative: bool = False):
        embeds, mask = (cond.neg_embeds, cond.neg_mask) if negative else (cond.embeds, cond.mask)
        return transformer_velocity(transformer, latents, sigmas, embeds, mask)

    def both_passes(self, transformer, latents, sigmas, cond: ZImagePromptEmbeds):
        """Prompts then negatives in one batch, as the pipeline runs them."""
        out = transformer_velocity(
            transformer,
            torch.cat([latents, latents]),
            torch.cat([sigmas, sigmas]),
            torch.cat([cond.embeds, cond.neg_embeds]),
            torch.cat([cond.mask, cond.neg_mask]),
        )
        text, uncond = out.chunk(2)
        return text, uncond

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        return vae_decode(pipe.vae, latents)

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Images in [0, 1] -> the transformer's latents, fp32 on the CPU."""
        return vae_encode(pipe.vae, images, device, inversion_steps)


FAMILY = ZImageFamily()
