"""Wan2.1 image-to-video (I2V 14B, 480P / 720P) as a model family: the Wan family's text
conditioning, noise, schedule, guidance and decoding (`omni.models.wan`), conditioned also on a
first frame, each prompt's source image (`data=edits`-style rows: an instruction and its image).

Sampling follows `WanImageToVideoPipeline.__call__` for one image:
- the image, at the rollout's resolution (a source of another size is refused: the pipeline
  would resize it), is `video_processor.preprocess`ed to [-1, 1]; the video condition is that
  frame followed by F - 1 black frames, encoded by the VAE (the posterior's mode) and
  normalised with its latents_mean / latents_std, after a mask of 4 channels that is 1 on the
  first frame's latent and 0 elsewhere: (B, 4 + 16, f, h, w), concatenated to the noisy latents
  on the channel axis at every transformer pass (in_channels 36);
- CLIP's vision tower's penultimate hidden states of the image (the pipeline's `encode_image`)
  enter every block's cross-attention beside the text (`encoder_hidden_states_image`), in both
  passes of classifier-free guidance;
- the noise is 16 channels (the VAE's), one clip per generator, as `prepare_latents` draws it.
The text and the CLIP states are encoded once per prompt (and cached with it); the video
condition depends on the frame count, so it is made when a rollout knows it
(`complete_conditioning`), one VAE encoding per clip.

Wan2.2's I2V A14B (two experts, no image encoder) and TI2V-5B's image mode (the first frame's
latent written into the noise, `expand_timesteps`) are refused at validation (`check_path`).
The tiny pipeline has every part a real checkpoint has, CLIP's vision model and image processor
included, built from a seed offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

from omni.data.edits import open_sources
from omni.data.prompts import source_images
from omni.models import wan
from omni.models.tiny_parts import cached_checkpoint, save_pipeline, t5_tokenizer

TINY_BUILDER_VERSION = 1
TINY_IMAGE_SIZE = 32  # CLIP's input side: (32 / 8)^2 patches + the class token
TINY_CLIP_WIDTH = 32
TINY_TRANSFORMER = dict(
    wan.TINY_TRANSFORMER,
    in_channels=36,  # the noise's 16, the mask's 4, the first frame's latents' 16
    image_dim=TINY_CLIP_WIDTH,
    added_kv_proj_dim=wan.TINY_TRANSFORMER["num_attention_heads"] * wan.TINY_TRANSFORMER["attention_head_dim"],
)
MASK_CHANNELS = 4  # the VAE's temporal factor: the first frame's mask, one channel per frame it stands for
# diffusers' Wan attention takes the image's tokens as all but the last 512 of the cross-attention
# context (a constant there), so the text must be exactly 512 tokens long
TEXT_CONTEXT = 512


def clip_vision(seed: int):
    """A 32-wide, two-layer CLIP vision tower and its image processor (32 px crops)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=TINY_CLIP_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TINY_IMAGE_SIZE,
        patch_size=8,
    )
    torch.manual_seed(seed)
    size = {"shortest_edge": TINY_IMAGE_SIZE}
    crop = {"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}
    return CLIPVisionModel(config), CLIPImageProcessor(size=size, crop_size=crop)


def build_tiny_wan_i2v_pipeline(seed: int = 0):
    """A complete random Wan I2V pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    tokenizer = t5_tokenizer(wan.TINY_TEXT_LENGTH)
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
    image_encoder, image_processor = clip_vision(seed + 3)
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=wan.umt5_encoder(tokenizer, seed + 2),
        vae=wan.wan_vae(seed + 1),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=wan.TINY_SHIFT),
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=transformer,
    )


def tiny_wan_i2v_path(cache_dir, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir,
        "wan-i2v-tiny",
        TINY_BUILDER_VERSION,
        seed,
        lambda path: save_pipeline(build_tiny_wan_i2v_pipeline(seed), path),
    )


@dataclass
class WanI2VConditioning(wan.WanPromptEmbeds):
    """Wan's text states, the first frame's CLIP states and pixels ([-1, 1]), and, once a
    rollout has made it for its frame count, the video condition (mask and latents)."""

    image_embeds: Optional[torch.Tensor] = None  # (B, 1 + patches, CLIP width)
    first_frame: Optional[torch.Tensor] = None  # (B, 3, H, W) in [-1, 1]
    condition: Optional[torch.Tensor] = None  # (B, 4 + 16, f, h, w)


class WanI2VFamily(wan.WanFamily):
    name = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    conditioning = WanI2VConditioning
    edit = True  # each prompt carries its first frame
    max_source_images = 1
    text_encoders = ("text_encoder", "image_encoder")
    # Wan's and the image's cross-attention keys and values: a LoRA without them would load
    # into the pipeline padded with zero adapters there (diffusers' T2V-to-I2V expansion)
    lora_targets = wan.WanFamily.lora_targets + ("add_k_proj", "add_v_proj")
    native = None
    published_configs = {
        "wan2.1-i2v-14b-480p": "wan2.1-i2v-14b-480p-transformer.json",
    }
    # umt5-xxl's encoder and CLIP ViT-H/14's vision tower; Wan2.1's VAE
    text_encoder_params = wan.WanFamily.text_encoder_params + 632_076_800

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_wan_i2v_path(cache_dir, seed)

    def tiny_transformer_config(self) -> dict:
        return dict(TINY_TRANSFORMER)

    def check_path(self, path: Optional[str], key: str = "model.path") -> Path:
        """A Wan2.1 I2V checkpoint: an image encoder, one transformer, no `expand_timesteps`."""
        root = super(wan.WanFamily, self).check_path(path, key)
        index = json.loads((root / "model_index.json").read_text())
        if (index.get("transformer_2") or [None])[0] is not None or index.get("expand_timesteps"):
            raise ValueError(
                f"{key}={path}: a Wan2.2 image-to-video checkpoint (two experts, or the first frame written into "
                "the noise): model=wan_i2v takes Wan2.1 I2V (14B 480P / 720P), whose first frame is a condition "
                "beside the noise"
            )
        if (index.get("image_encoder") or [None])[0] is None:
            raise ValueError(f"{key}={path}: no image_encoder in model_index.json; model=wan_i2v takes Wan2.1 I2V")
        return root

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        super().check_settings(transformer_config, model, rollout)
        if model.max_sequence_length != TEXT_CONTEXT:
            raise ValueError(
                f"model.max_sequence_length={model.max_sequence_length}: Wan's image-to-video attention splits the "
                f"first frame's tokens off the text at {TEXT_CONTEXT} tokens (diffusers' constant); set "
                f"model.max_sequence_length={TEXT_CONTEXT}"
            )

    def source_problem(self, prompt, resolution: int) -> Optional[str]:
        """A first frame not of the rollout's size (the pipeline would resize it; we sample at its size)."""
        from PIL import Image

        for path in source_images(prompt):
            try:
                with Image.open(path) as image:  # reads the header only
                    size = image.size
            except (OSError, ValueError) as error:
                return f"its first frame {path} cannot be read ({error})"
            if size != (resolution, resolution):
                return (
                    f"its first frame {path} is {size[0]}x{size[1]} pixels but the clips are "
                    f"{resolution}x{resolution} (rollout.resolution / eval.resolution): give first frames of "
                    "the clips' size"
                )
        return None

    def pipeline_sources(self, prompts, resolution: int) -> dict:
        return {"image": self._source(prompts[0])}

    def _source(self, prompt):
        sources = open_sources(prompt)
        if len(sources) > 1:
            where = getattr(prompt, "origin", "") or repr(str(prompt)[:60])
            raise ValueError(f"{where}: image-to-video takes one first frame, this prompt has {len(sources)}")
        return sources[0]

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> WanI2VConditioning:
        """Wan's text states, then each prompt's first frame: its CLIP states and pixels."""
        frames = [self._source(prompt) for prompt in prompts]
        text = super().encode_prompts(pipe, prompts, guidance_scale, max_sequence_length, device)
        with torch.no_grad():
            image_embeds = torch.cat([pipe.encode_image(frame, device) for frame in frames])
            pixels = torch.cat([pipe.video_processor.preprocess(frame) for frame in frames]).float()
        return WanI2VConditioning(text.embeds, text.neg_embeds, image_embeds, pixels.to(device))

    def complete_conditioning(self, pipe, cond: WanI2VConditioning, resolution: int, num_frames: int):
        """The video condition for clips of `num_frames` frames at `resolution` (see the module
        docstring), made once per distinct first frame."""
        if cond.first_frame.shape[-2:] != (resolution, resolution):
            raise ValueError(
                f"a first frame of {tuple(cond.first_frame.shape[-2:])} pixels for rollout.resolution={resolution}: "
                "image-to-video samples at the first frame's size; give sources of the rollout's size"
            )
        vae = pipe.vae
        distinct, rows = torch.unique(cond.first_frame.flatten(1), dim=0, return_inverse=True)
        frames = distinct.view(-1, *cond.first_frame.shape[1:])
        video = torch.cat([frames[:, :, None], frames.new_zeros(len(frames), 3, num_frames - 1, *frames.shape[-2:])], 2)
        with torch.no_grad():
            latents = vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode().float()
        mean, std = wan.latent_stats(vae, latents.device, latents.dtype)
        latents = ((latents - mean) / std)[rows]
        mask = torch.zeros(len(latents), MASK_CHANNELS, *latents.shape[2:], device=latents.device)
        mask[:, :, 0] = 1
        condition = torch.cat([mask, latents], 1).to(cond.embeds.device, cond.embeds.dtype)
        return WanI2VConditioning(cond.embeds, cond.neg_embeds, cond.image_embeds, cond.first_frame, condition)

    def velocity_pass(self, transformer, latents, sigmas, cond: WanI2VConditioning, negative: bool = False):
        embeds = cond.neg_embeds if negative else cond.embeds
        return transformer(
            hidden_states=torch.cat([latents, cond.condition.to(latents.dtype)], 1),
            timestep=sigmas.float() * 1000,
            encoder_hidden_states=embeds,
            encoder_hidden_states_image=cond.image_embeds,
            return_dict=False,
        )[0].float()

    def both_passes(self, transformer, latents, sigmas, cond: WanI2VConditioning):
        """The prompts and the negative prompt in one batch, the image states in both."""
        timesteps = sigmas.float() * 1000
        hidden = torch.cat([latents, cond.condition.to(latents.dtype)], 1)
        out = transformer(
            hidden_states=torch.cat([hidden, hidden]),
            timestep=torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([cond.embeds, cond.neg_embeds]),
            encoder_hidden_states_image=torch.cat([cond.image_embeds, cond.image_embeds]),
            return_dict=False,
        )[0]
        text, uncond = out.float().chunk(2)
        return text, uncond


FAMILY = WanI2VFamily()
