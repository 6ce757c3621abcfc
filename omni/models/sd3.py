"""Stable Diffusion 3 / 3.5 as a model family: a tiny random checkpoint built offline, SD3's
text conditioning (two CLIPs and T5, pooled and sequence embeddings), 4-D latents, the
MMDiT's velocity with classifier-free guidance, and LoRA export for
`StableDiffusion3Pipeline.load_lora_weights`.

The MMDiT's last block drops its text tokens' outputs (`context_pre_only`), so its attention
computes only the image tokens' queries (`ImageQueryAttention`): the text tokens still give
their keys and values, and the image tokens' outputs are the same bits as diffusers'
(attention rows are independent), only without the text rows nothing reads.

The tiny pipeline has every part a real SD3 checkpoint has (MMDiT transformer, two CLIP
text encoders with projection, a T5 encoder, a VAE, the flow-matching scheduler and real
tokenizer classes), built in memory from a seed, saved to a directory and then loaded with
`StableDiffusion3Pipeline.from_pretrained` like any real checkpoint. No hub access.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import JointAttnProcessor2_0

from omni.models.base import Conditioning, ModelFamily, vae_decode, vae_encode
from omni.models.native import NativePipeline
from omni.models.tiny_parts import (
    TINY_VAE_FACTOR,
    autoencoder_kl,
    cached_checkpoint,
    clip_encoder,
    clip_tokenizer,
    save_pipeline,
    t5_encoder,
    t5_tokenizer,
)

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 4

TINY_TRANSFORMER = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=64,
    pooled_projection_dim=64,
    out_channels=4,
    pos_embed_max_size=32,
)
TINY_TEXT_LENGTH = 16
# The SD3.5 checkpoints' scheduler/scheduler_config.json (Medium and Large alike).
SCHEDULER = dict(shift=3.0)


def tiny_transformer_config(**overrides) -> dict:
    """Config of the tiny SD3 transformer (also used alone by the FSDP tests)."""
    return {**TINY_TRANSFORMER, **overrides}


def build_tiny_transformer(seed: int = 0, **overrides):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(**tiny_transformer_config(**overrides))


def build_tiny_sd3_pipeline(seed: int = 0, clip_length: int = TINY_TEXT_LENGTH, t5_length: int = TINY_TEXT_LENGTH):
    """A complete random SD3 pipeline, identical for identical seeds. `clip_length`: the
    CLIP tokenizers' and encoders' length (real SD3: 77); `t5_length`: the T5 tokenizer's."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    clip_tok = clip_tokenizer(clip_length)
    t5_tok = t5_tokenizer(t5_length)
    return StableDiffusion3Pipeline(
        transformer=build_tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=autoencoder_kl(seed + 1, TINY_TRANSFORMER["in_channels"], shift_factor=0.0609, scaling_factor=1.5305),
        text_encoder=clip_encoder(clip_tok, seed + 2),
        tokenizer=clip_tok,
        text_encoder_2=clip_encoder(clip_tok, seed + 3),
        tokenizer_2=clip_tokenizer(clip_length),
        text_encoder_3=t5_encoder(t5_tok, seed + 4, TINY_TRANSFORMER["joint_attention_dim"]),
        tokenizer_3=t5_tok,
    )


def write_tiny_sd3(
    out_dir: str | os.PathLike, seed: int = 0, clip_length: int = TINY_TEXT_LENGTH, t5_length: int = TINY_TEXT_LENGTH
) -> Path:
    """Build the tiny pipeline (text lengths as in `build_tiny_sd3_pipeline`) and save it to
    `out_dir` atomically (never half-written)."""
    return save_pipeline(build_tiny_sd3_pipeline(seed, clip_length, t5_length), out_dir)


def tiny_sd3_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(cache_dir, "sd3-tiny", TINY_BUILDER_VERSION, seed, lambda path: write_tiny_sd3(path, seed))


@dataclass
class PromptEmbeds(Conditioning):
    """SD3's two text conditions per prompt (sequence and pooled), with CFG negatives."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_pooled: Optional[torch.Tensor] = None


class SD3Native(NativePipeline):
    """vLLM-Omni's SD3 pipeline under `rollout.options.backend=native`."""

    # vLLM-Omni 0.30's SD3 forward encodes a request's prompt once for all its outputs (the
    # text embeddings are not repeated per image): a request per image
    groups_outputs = False

    pipeline = "vllm_omni.diffusion.models.sd3.pipeline_sd3.StableDiffusion3Pipeline"
    cond_arguments = (
        "prompt_embeds",
        "pooled_prompt_embeds",
        "negative_prompt_embeds",
        "negative_pooled_prompt_embeds",
    )

    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        return sigmas * 1000  # SD3's transformer takes t = 1000 sigma

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts, guidance_scale: float, max_sequence_length: int):
        """From vLLM-Omni's text encoders (negatives: the empty prompt)."""

        def encode(texts):
            return pipe.encode_prompt(
                prompt=texts, prompt_2=None, prompt_3=None, max_sequence_length=max_sequence_length
            )

        embeds, pooled = encode(list(prompts))
        negatives = encode([""] * len(prompts)) if guidance_scale > 1 else (None, None)
        return pipe.family.conditioning(embeds, pooled, *negatives).apply(lambda t: t.cpu())


class ImageQueryAttention(JointAttnProcessor2_0):
    """Joint attention of a block whose text outputs are dropped (`attn.context_pre_only`,
    the MMDiT's last block): the image tokens' queries attend to every token; the text
    tokens' queries are not computed. On a small image with long text (a 64 px image is 16
    tokens beside SD3's 205 of text) that is most of the block's attention. While a gradient
    could reach the text query projection's own parameters (full fine-tuning), the block
    runs diffusers' whole computation, so that projection gets the zero gradient it gets
    there, as optimizers and the gradient all-reduce of every worker layout expect."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if encoder_hidden_states is None or not attn.context_pre_only or _trains(attn.add_q_proj):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        batch, heads = hidden_states.shape[0], attn.heads

        def split(tokens: torch.Tensor) -> torch.Tensor:
            return tokens.view(batch, -1, heads, tokens.shape[-1] // heads).transpose(1, 2)

        query, key, value = (split(proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        text_key = split(attn.add_k_proj(encoder_hidden_states))
        text_value = split(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        out = F.scaled_dot_product_attention(
            query, torch.cat([key, text_key], dim=2), torch.cat([value, text_value], dim=2), dropout_p=0.0
        )
        out = out.transpose(1, 2).reshape(batch, -1, out.shape[1] * out.shape[3]).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out)), None


def _trains(module: torch.nn.Module) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())


def use_image_query_attention(transformer) -> None:
    """Give each block of `transformer` that drops its text outputs `ImageQueryAttention`."""
    for block in transformer.transformer_blocks:
        if block.context_pre_only:
            block.attn.set_processor(ImageQueryAttention())


class SD3Family(ModelFamily):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    conditioning = PromptEmbeds
    layer_prefixes = ("transformer_blocks.",)
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoders = ("text_encoder", "text_encoder_2", "text_encoder_3")
    vllm_served = True
    native = SD3Native()
    published_configs = {"sd3.5-medium": "sd3.5-medium-transformer.json", "sd3.5-large": "sd3.5-large-transformer.json"}
    # CLIP-L/14, OpenCLIP bigG/14 and the T5-XXL encoder; the 16-channel VAE (published configs).
    text_encoder_params = 123_650_560 + 694_659_840 + 4_762_310_656
    vae_params = 83_819_683
    published_vae_config = "sd3.5-vae.json"

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_sd3_path(cache_dir, seed)

    def unused_modules(self, transformer_config: dict) -> List[str]:
        """The last block's text query projection: that block drops its text outputs."""
        return [f"transformer_blocks.{transformer_config['num_layers'] - 1}.attn.add_q_proj"]

    def apply_settings(self, transformer, model) -> None:
        use_image_query_attention(transformer)

    def published_scheduler_config(self, transformer_config: dict) -> dict:
        return dict(SCHEDULER)

    def tiny_transformer_config(self) -> dict:
        return tiny_transformer_config()

    def tiny_resolution_multiple(self) -> int:
        return TINY_VAE_FACTOR * TINY_TRANSFORMER["patch_size"]

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        """Image patches plus the joint text sequence (CLIP's 77 tokens, then T5's)."""
        return (resolution // (8 * transformer_config["patch_size"])) ** 2 + 77 + max_sequence_length

    def forward_passes(self, guidance_scale: float) -> int:
        return 2 if guidance_scale > 1 else 1

    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> PromptEmbeds:
        """Text embeddings of `prompts` (and of the empty negative prompt under CFG)."""
        with torch.no_grad():
            embeds, neg_embeds, pooled, neg_pooled = pipe.encode_prompt(
                prompt=list(prompts),
                prompt_2=None,
                prompt_3=None,
                device=device,
                do_classifier_free_guidance=guidance_scale > 1,
                negative_prompt="",
                max_sequence_length=max_sequence_length,
            )
        return PromptEmbeds(embeds, pooled, neg_embeds, neg_pooled)

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        channels, size = pipe.transformer.config.in_channels, resolution // pipe.vae_scale_factor
        return torch.stack([torch.randn(channels, size, size, generator=g) for g in generators])

    # Timesteps are fp32 (the transformer's sinusoidal embedding computes in fp32 anyway):
    # sigma rounded to bf16 before x1000 would be off by up to 2 timesteps.
    def velocity_pass(self, transformer, latents, sigmas, cond: PromptEmbeds, negative: bool = False):
        embeds, pooled = (cond.neg_embeds, cond.neg_pooled) if negative else (cond.embeds, cond.pooled)
        return transformer(
            hidden_states=latents,
            timestep=sigmas.float() * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0].float()

    def both_passes(self, transformer, latents, sigmas, cond: PromptEmbeds):
        """Negatives and positives in one batch, as the pipeline runs them."""
        timesteps = sigmas.float() * 1000
        out = transformer(
            hidden_states=torch.cat([latents, latents]),
            timestep=torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([cond.neg_embeds, cond.embeds]),
            pooled_projections=torch.cat([cond.neg_pooled, cond.pooled]),
            return_dict=False,
        )[0]
        uncond, text = out.float().chunk(2)
        return text, uncond

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        return vae_decode(pipe.vae, latents)

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Images in [0, 1] -> the transformer's latents, fp32 on the CPU."""
        return vae_encode(pipe.vae, images, device, inversion_steps)


FAMILY = SD3Family()
