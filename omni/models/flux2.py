"""FLUX.2 [klein] (Black Forest Labs' 4B/9B DiT with a Qwen3 text encoder) as a model family: a
tiny random checkpoint built offline, Qwen3's stacked hidden states as the conditioning, the
FLUX.2 VAE's patchified and batch-normalised latents packed into tokens, the empirical
timestep shift, classifier-free guidance for the klein base models, and LoRA export for
`Flux2KleinPipeline.load_lora_weights`.

Sampling follows `Flux2KleinPipeline.__call__`:
- a prompt is wrapped in the tokenizer's chat template (a user turn, the assistant's header,
  thinking disabled), padded to `max_sequence_length`; the conditioning is the text encoder's
  hidden states after layers 9, 18 and 27, concatenated per token (B, L, 3 * width). Every
  padded token goes to the transformer (no mask), with text positions (0, 0, 0, l);
- the noise is drawn as (B, 128, h, w) for an image of 16h x 16w (32 VAE channels in 2x2
  patches: the VAE's own latent space, normalised by its batch-norm statistics) and packed
  row by row into (B, h * w, 128) tokens with positions (0, row, column, 0);
- the noise levels are `linspace(1, 1/n, n)` shifted by exp(mu), mu from
  `compute_empirical_mu` (a fit in the number of image tokens and of steps);
- the transformer takes sigma (the pipeline's timestep / 1000) and predicts the velocity;
  no guidance embedding;
- guidance: the distilled klein checkpoints (`is_distilled` in model_index.json) ignore it
  and sample in one pass; the klein base checkpoints take classifier-free guidance on the
  negative prompt "" whenever the scale is above 1, v = neg + s (pos - neg). We guide as the
  base does and refuse a scale above 1 for a distilled checkpoint (`check_settings`), where
  the pipeline would silently drop it;
- decoding un-normalises with the VAE's batch-norm statistics and un-patchifies before the
  VAE's decoder.

The tiny pipeline has every part a real checkpoint has (Flux2Transformer2DModel with double-
and single-stream blocks, a 28-layer 32-wide Qwen3ForCausalLM with the written-out byte-level
tokenizer and chat template, an AutoencoderKLFlux2 with non-trivial batch-norm statistics, the
klein scheduler config), built in memory from a seed and loaded with
`Flux2KleinPipeline.from_pretrained` like a real checkpoint. It is a base (non-distilled)
pipeline, so the contract exercises guidance. No hub access.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from omni.models.base import Conditioning, ModelFamily, invert_decoder
from omni.models.tiny_parts import (
    TINY_DECODER_GAIN,
    TINY_VAE_CHANNELS,
    TINY_VAE_FACTOR,
    cached_checkpoint,
    save_pipeline,
)
from omni.models.z_image import z_image_tokenizer

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 1

# The pipeline stacks these hidden states (its `text_encoder_out_layers` default), so the tiny
# Qwen3 needs more than 27 layers; 28 keeps layer 27 an inner one, as in the real 36-layer model.
TEXT_LAYERS = (9, 18, 27)
TINY_TEXT_WIDTH = 32
TINY_TEXT_LAYERS = 28
VAE_CHANNELS = 32  # the FLUX.2 VAE's latent channels; 128 once patchified 2x2
TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=4 * VAE_CHANNELS,
    num_layers=1,  # one block in each container: the layered sync walks both
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=len(TEXT_LAYERS) * TINY_TEXT_WIDTH,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
    guidance_embeds=False,
)
# The klein checkpoints' scheduler, as far as sampling reads it: dynamic (exponential) shifting
# with mu given by the pipeline; the other keys are FlowMatchEulerDiscreteScheduler's FLUX
# values and unused once mu is given.
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)
NEGATIVE_PROMPT = ""  # the pipeline's fixed negative prompt


def qwen3_causal_lm(tokenizer, seed: int):
    """A 32-wide Qwen3ForCausalLM (the class the pipeline loads) with tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TINY_TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=TINY_TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def flux2_vae(seed: int):
    """A four-level AutoencoderKLFlux2 with random batch-norm statistics (so un-normalising
    matters) and its decoder's output layer scaled by `TINY_DECODER_GAIN`."""
    from diffusers import AutoencoderKLFlux2

    channels = TINY_VAE_CHANNELS
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=VAE_CHANNELS,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(TINY_DECODER_GAIN)
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) + 0.5)
    return vae


def build_tiny_flux2_pipeline(seed: int = 0, distilled: bool = False):
    """A complete random FLUX.2 [klein] pipeline, identical for identical seeds; base-like
    (guidance on above 1) unless `distilled`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    tokenizer = z_image_tokenizer()
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**TINY_TRANSFORMER)
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=flux2_vae(seed + 1),
        text_encoder=qwen3_causal_lm(tokenizer, seed + 2),
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=distilled,
    )


def write_tiny_flux2(out_dir: str | os.PathLike, seed: int = 0, distilled: bool = False) -> Path:
    """Build the tiny pipeline and save it to `out_dir` atomically (never half-written)."""
    return save_pipeline(build_tiny_flux2_pipeline(seed, distilled), out_dir)


def tiny_flux2_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny (base-like) pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir, "flux2-klein-tiny", TINY_BUILDER_VERSION, seed, lambda path: write_tiny_flux2(path, seed)
    )


# ----------------------------------------------------------------- latent layout
def pack_tokens(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) patchified latents -> (B, h * w, C) tokens, row by row."""
    return latents.flatten(2).transpose(1, 2)


def unpack_tokens(tokens: torch.Tensor, side: int) -> torch.Tensor:
    """The inverse of `pack_tokens` for a square latent of `side` x `side` tokens."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], side, side)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 2h, 2w) VAE latents -> (B, 4C, h, w), each 2x2 patch's values on channels."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return patches.reshape(b, c // 4, h * 2, w * 2)


def batch_norm_stats(vae, like: torch.Tensor):
    """The VAE's latent (mean, std), shaped to broadcast over (B, 4C, h, w)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def decode_tokens(vae, tokens: torch.Tensor) -> torch.Tensor:
    """Packed tokens -> images (B, 3, H, W) in [0, 1], fp32, differentiable."""
    latents = unpack_tokens(tokens, int(tokens.shape[1] ** 0.5))
    mean, std = batch_norm_stats(vae, latents)
    images = vae.decode(unpatchify(latents * std + mean).to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


def token_ids(rows: int, cols: int, device) -> torch.Tensor:
    """Positions (0, row, column, 0) of the packed image tokens."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    zero = torch.zeros_like(r)
    return torch.stack([zero, r, c, zero], dim=-1).reshape(rows * cols, 4).to(device)


def text_ids(length: int, device) -> torch.Tensor:
    """Positions (0, 0, 0, l) of the text tokens."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.to(device)


@dataclass
class Flux2PromptEmbeds(Conditioning):
    """FLUX.2's text conditioning per prompt: the stacked hidden states of the padded prompt,
    and the negative prompt's under classifier-free guidance."""

    embeds: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None


class Flux2Family(ModelFamily):
    name = "flux2"
    pipeline_class = "Flux2KleinPipeline"
    transformer_class = "Flux2Transformer2DModel"
    conditioning = Flux2PromptEmbeds
    layer_prefixes = ("transformer_blocks.", "single_transformer_blocks.")
    # The double-stream blocks' image attention and the single-stream blocks' fused QKV+MLP
    # input. Their output projection `to_out` is not a target: as a suffix it would also name
    # the double-stream blocks' `to_out` container, which is no Linear.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj")
    text_encoders = ("text_encoder",)
    published_configs = {"flux.2-klein-4b": "flux.2-klein-4b-transformer.json"}
    # Qwen3-4B (Qwen3ForCausalLM, its LM head tied to the embeddings) counted from its published
    # config on the meta device, as for Z-Image; the FLUX.2 VAE from `flux.2-vae.json`.
    text_encoder_params = 4_022_468_096
    vae_params = 84_046_115
    published_vae_config = "flux.2-vae.json"

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_flux2_path(cache_dir, seed)

    def tiny_transformer_config(self) -> dict:
        return dict(TINY_TRANSFORMER)

    def published_scheduler_config(self, transformer_config: dict) -> dict:
        return dict(SCHEDULER)

    def tiny_resolution_multiple(self) -> int:
        return TINY_VAE_FACTOR * 2

    def resolution_multiple(self, path) -> int:
        """The VAE's downsampling times the 2x2 patchification (the transformer's patch is 1)."""
        vae = json.loads((Path(path).expanduser() / "vae" / "config.json").read_text())
        return 2 ** (len(vae["block_out_channels"]) - 1) * 2

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        return (resolution // 16) ** 2 + max_sequence_length

    def forward_passes(self, guidance_scale: float) -> int:
        return 2 if guidance_scale > 1 else 1

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        if model.path and rollout.guidance_scale > 1 and distilled(model.path):
            raise ValueError(
                f"rollout.guidance_scale={rollout.guidance_scale}: model.path={model.path} is a distilled FLUX.2 "
                f"[klein] checkpoint (is_distilled in model_index.json), which samples without guidance; set "
                f"model.guidance_scale=1.0, or train the klein base checkpoint for classifier-free guidance"
            )

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> Flux2PromptEmbeds:
        """The prompts' (and under guidance the negative prompt's) stacked hidden states."""
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(list(prompts), device=device, max_sequence_length=max_sequence_length)
            neg = None
            if self.forward_passes(guidance_scale) == 2:
                neg, _ = pipe.encode_prompt([NEGATIVE_PROMPT], device=device, max_sequence_length=max_sequence_length)
                neg = neg.expand(len(prompts), *neg.shape[1:])
        return Flux2PromptEmbeds(embeds, neg)

    def sigmas(self, pipe, num_steps: int, resolution: int) -> torch.Tensor:
        """Flux2KleinPipeline's schedule: linspace(1, 1/n, n) shifted by the empirical mu, then 0."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        tokens = (resolution // (pipe.vae_scale_factor * 2)) ** 2
        sigmas = torch.linspace(1.0, 1 / num_steps, num_steps).numpy()
        pipe.scheduler.set_timesteps(sigmas=sigmas, mu=compute_empirical_mu(tokens, num_steps), device="cpu")
        return pipe.scheduler.sigmas.float().clone()

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        """Noise drawn as the pipeline draws it, (128, h, w) per image, then packed."""
        side = resolution // (pipe.vae_scale_factor * 2)
        channels = pipe.transformer.config.in_channels
        return pack_tokens(torch.stack([torch.randn(channels, side, side, generator=g) for g in generators]))

    def velocity_pass(self, transformer, latents, sigmas, cond: Flux2PromptEmbeds, negative: bool = False):
        embeds = cond.neg_embeds if negative else cond.embeds
        side = int(latents.shape[1] ** 0.5)
        timestep = sigmas.float() * 1000 / 1000  # the pipeline's scheduler timestep / 1000
        return transformer(
            hidden_states=latents,
            timestep=timestep.to(latents.dtype),
            guidance=None,
            encoder_hidden_states=embeds,
            txt_ids=text_ids(embeds.shape[1], latents.device),
            img_ids=token_ids(side, side, latents.device),
            return_dict=False,
        )[0].float()

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        with torch.no_grad():
            return decode_tokens(pipe.vae, latents)

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Images in [0, 1] -> packed, normalised tokens, fp32 on the CPU: the VAE posterior's
        mode (as the pipeline encodes reference images) or the decoder's inversion."""
        vae = pipe.vae
        if inversion_steps:
            side = images.shape[-1] // (2 ** (len(vae.config.block_out_channels) - 1) * 2)
            shape = (side * side, 4 * vae.config.latent_channels)
            return invert_decoder(vae, images, device, inversion_steps, lambda t: decode_tokens(vae, t), shape)
        with torch.no_grad():
            latents = patchify(vae.encode((images * 2 - 1).to(device, vae.dtype)).latent_dist.mode().float())
            mean, std = batch_norm_stats(vae, latents)
        return pack_tokens((latents - mean) / std).cpu()


def distilled(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at `path` is a step-distilled klein (its pipeline ignores guidance)."""
    index = Path(path).expanduser() / "model_index.json"
    return index.is_file() and bool(json.loads(index.read_text()).get("is_distilled", False))


FAMILY = Flux2Family()
