"""FLUX.1 (dev and schnell) as a model family: a tiny random checkpoint built offline, FLUX's
text conditioning (T5 sequence embeddings and CLIP's pooled output), packed latents, the
resolution-dependent timestep shift, the distilled guidance embedding, and LoRA export for
`FluxPipeline.load_lora_weights`.

Sampling follows `FluxPipeline.__call__`:
- latents are 16-channel VAE latents cut into 2x2 patches and packed into a sequence of
  64-wide tokens, (B, (H/16) * (W/16), 64) for an H x W image (the channels and the VAE's
  factor are read from the checkpoint: the micro FLUX.1 Kontext's 4-channel VAE of factor 4
  gives (B, (H/8) * (W/8), 16)); the transformer gets the
  position of each token (`img_ids`) and all-zero text positions (`txt_ids`);
- the noise levels are `linspace(1, 1/n, n)` shifted by exp(mu), with mu linear in the
  number of image tokens (dev's dynamic shifting; schnell's scheduler has none);
- FLUX.1-dev is guidance-distilled: `guidance_scale` enters the transformer as an embedding,
  in one forward pass (no classifier-free guidance, no negative prompt). FLUX.1-schnell has
  no guidance embedding and takes no guidance (`check_settings` refuses one).

The tiny pipeline has every part a real FLUX checkpoint has (FluxTransformer2DModel, CLIP and
T5 text encoders with real tokenizer classes, a 16-channel AutoencoderKL, FLUX.1-dev's
scheduler config), built in memory from a seed and loaded with `FluxPipeline.from_pretrained`
like any real checkpoint. No hub access.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import torch

from omni.models.base import Conditioning, ModelFamily, vae_decode, vae_encode
from omni.models.native import NativePipeline, packed_step_noise
from omni.models.packing import pack, packed_noise, shifted_sigmas, unpack
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
TINY_BUILDER_VERSION = 2

TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,  # 16 VAE channels x a 2x2 patch
    num_layers=1,  # one block in each container: the layered sync walks both
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=64,  # the tiny T5's width
    pooled_projection_dim=32,  # the tiny CLIP's width
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
TINY_TEXT_LENGTH = 16
VAE_CHANNELS = 16
# FLUX's autoencoder normalisation (vae/config.json of FLUX.1-dev).
VAE_SHIFT_FACTOR, VAE_SCALING_FACTOR = 0.1159, 0.3611
# FLUX.1-dev's scheduler/scheduler_config.json; schnell's has a fixed shift of 1.
DEV_SCHEDULER = dict(
    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
)
SCHNELL_SCHEDULER = dict(shift=1.0, use_dynamic_shifting=False)
# The T5 context FluxPipeline accepts.
MAX_SEQUENCE_LENGTH = 512


def build_tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True):
    """A complete random FLUX pipeline, identical for identical seeds; `guidance_embeds`
    False gives a schnell-like one (no guidance embedding, no dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_tok = clip_tokenizer(TINY_TEXT_LENGTH)
    t5_tok = t5_tokenizer(TINY_TEXT_LENGTH)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**{**TINY_TRANSFORMER, "guidance_embeds": guidance_embeds})
    return FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if guidance_embeds else SCHNELL_SCHEDULER)),
        vae=autoencoder_kl(seed + 1, VAE_CHANNELS, VAE_SHIFT_FACTOR, VAE_SCALING_FACTOR),
        text_encoder=clip_encoder(clip_tok, seed + 2, with_projection=False),
        tokenizer=clip_tok,
        text_encoder_2=t5_encoder(t5_tok, seed + 3, TINY_TRANSFORMER["joint_attention_dim"]),
        tokenizer_2=t5_tok,
    )


def write_tiny_flux(out_dir: str | os.PathLike, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Build the tiny pipeline and save it to `out_dir` atomically (never half-written)."""
    return save_pipeline(build_tiny_flux_pipeline(seed, guidance_embeds), out_dir)


def tiny_flux_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny (dev-like) pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir, "flux-tiny", TINY_BUILDER_VERSION, seed, lambda path: write_tiny_flux(path, seed)
    )


def image_ids(tokens: int, device, dtype) -> torch.Tensor:
    """Positions (0, row, column) of a square image's packed tokens, as FluxPipeline makes them."""
    side = math.isqrt(tokens)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(side * side, 3)
    return ids.to(device=device, dtype=dtype)


@dataclass
class FluxPromptEmbeds(Conditioning):
    """FLUX's text conditioning per prompt: T5's sequence and CLIP's pooled embedding."""

    embeds: torch.Tensor
    pooled: torch.Tensor


class FluxNative(NativePipeline):
    """vLLM-Omni's FLUX.1 pipeline (dev's distilled guidance, or schnell's none) under
    `rollout.options.backend=native`: its loop gives the transformer the same fp32 guidance
    vector the actor does; latents stay packed, as vLLM-Omni packs them."""

    pipeline = "vllm_omni.diffusion.models.flux.pipeline_flux.FluxPipeline"
    cond_arguments = ("prompt_embeds", "pooled_prompt_embeds")
    noise = staticmethod(packed_step_noise)

    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        return sigmas  # FLUX's transformer takes sigma (and multiplies it by 1000 itself)

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts, guidance_scale: float, max_sequence_length: int):
        """T5's sequence and CLIP's pooled embedding from vLLM-Omni's encoders (no negative prompt)."""
        embeds, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, max_sequence_length=max_sequence_length
        )
        return FluxPromptEmbeds(embeds, pooled).apply(lambda t: t.cpu())


class FluxFamily(ModelFamily):
    name = "flux"
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    conditioning = FluxPromptEmbeds
    layer_prefixes = ("transformer_blocks.", "single_transformer_blocks.")
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoders = ("text_encoder", "text_encoder_2")
    native = FluxNative()
    published_configs = {
        "flux.1-dev": "flux.1-dev-transformer.json",
        "flux.1-schnell": "flux.1-schnell-transformer.json",
    }
    # CLIP ViT-L/14's text model and the T5-XXL encoder; the 16-channel autoencoder.
    text_encoder_params = 123_060_480 + 4_762_310_656
    vae_params = 83_819_683
    published_vae_config = "flux.1-vae.json"

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_flux_path(cache_dir, seed)

    def published_scheduler_config(self, transformer_config: dict) -> dict:
        """dev's (dynamic shift) for a transformer with a guidance embedding, else schnell's."""
        return dict(DEV_SCHEDULER if transformer_config.get("guidance_embeds", False) else SCHNELL_SCHEDULER)

    def tiny_transformer_config(self) -> dict:
        return dict(TINY_TRANSFORMER)

    def tiny_resolution_multiple(self) -> int:
        return TINY_VAE_FACTOR * 2

    def resolution_multiple(self, path) -> int:
        """The VAE's downsampling times the 2x2 packing (the transformer's own patch is 1)."""
        import json

        vae = json.loads((Path(path).expanduser() / "vae" / "config.json").read_text())
        return 2 ** (len(vae["block_out_channels"]) - 1) * 2

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        return (resolution // 16) ** 2 + max_sequence_length

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        if not transformer_config.get("guidance_embeds", False) and rollout.guidance_scale != 0:
            raise ValueError(
                f"rollout.guidance_scale={rollout.guidance_scale}: this FLUX transformer has no guidance embedding "
                f"(FLUX.1-schnell) and takes no guidance; set model.guidance_scale=0 (only FLUX.1-dev's distilled "
                f"guidance takes a scale, and FLUX has no classifier-free guidance here)"
            )
        if model.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"model.max_sequence_length={model.max_sequence_length}: FLUX's T5 takes at most "
                f"{MAX_SEQUENCE_LENGTH} tokens"
            )

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> FluxPromptEmbeds:
        """T5 and pooled CLIP embeddings of `prompts` (FLUX has no negative prompt)."""
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(
                prompt=list(prompts), prompt_2=None, device=device, max_sequence_length=max_sequence_length
            )
        return FluxPromptEmbeds(embeds, pooled)

    def sigmas(self, pipe, num_steps: int, resolution: int) -> torch.Tensor:
        """FluxPipeline's schedule (`shifted_sigmas`)."""
        return shifted_sigmas(pipe, num_steps, resolution)

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        return packed_noise(pipe, generators, resolution)

    def predict_velocity(
        self, transformer, latents, sigmas, cond: FluxPromptEmbeds, guidance_scale: float, uncond_grad: bool = True
    ):
        """The transformer's velocity at noise levels `sigmas` (FLUX takes sigma itself as the
        timestep), with FLUX.1-dev's guidance embedding when the transformer has one (one
        pass: there is no unconditional pass, so `uncond_grad` changes nothing)."""
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full(
                (latents.shape[0],), float(guidance_scale), device=latents.device, dtype=torch.float32
            )
        hidden_states, ids = self.image_tokens(latents, cond)
        return transformer(
            hidden_states=hidden_states,
            timestep=sigmas,
            guidance=guidance,
            pooled_projections=cond.pooled,
            encoder_hidden_states=cond.embeds,
            txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=latents.device, dtype=latents.dtype),
            img_ids=ids,
            return_dict=False,
        )[0][:, : latents.shape[1]].float()

    def image_tokens(self, latents: torch.Tensor, cond: FluxPromptEmbeds):
        """The transformer's image tokens and their positions: the packed latents alone for
        FLUX.1 (a family that appends reference tokens, FLUX.1 Kontext, adds them here; the
        velocity is the output at the latents' own tokens)."""
        return latents, image_ids(latents.shape[1], latents.device, latents.dtype)

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        return vae_decode(pipe.vae, unpack(latents))

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Images in [0, 1] -> packed latents, fp32 on the CPU."""
        return pack(vae_encode(pipe.vae, images, device, inversion_steps))


FAMILY = FluxFamily()
