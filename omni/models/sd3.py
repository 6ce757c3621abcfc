"""Stable Diffusion 3 / 3.5 as a model family: a tiny random checkpoint built offline, SD3's
text conditioning (two CLIPs and T5, pooled and sequence embeddings), 4-D latents, the
MMDiT's velocity with classifier-free guidance, and LoRA export for
`StableDiffusion3Pipeline.load_lora_weights`.

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
