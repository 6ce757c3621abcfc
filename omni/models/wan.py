"""Wan (Wan2.1 T2V 1.3B / 14B, Wan2.2 TI2V-5B) as a video model family: a tiny random
checkpoint built offline, UMT5's text conditioning, 5-D video latents, classifier-free
guidance on the empty negative prompt, the 3-D VAE's per-channel normalisation, decoding in
frame chunks, and LoRA export for `WanPipeline.load_lora_weights`.

Sampling follows `WanPipeline.__call__`:
- a prompt (cleaned by the pipeline's `prompt_clean`) is tokenized to `max_sequence_length`
  tokens; UMT5's last hidden states of its real tokens are kept and the rest set to zero, so
  every row has the same length and the transformer takes no mask;
- latents are (C, (F - 1) / 4 + 1, H / 8, W / 8) per clip (the VAE's temporal factor 4 and
  spatial factor 8; Wan2.2's VAE has 48 channels and factor 16), drawn per clip from its own
  generator as `prepare_latents` draws them;
- the transformer takes the timestep sigma x 1000 and, under CFG (`rollout.guidance_scale`
  > 1), a second pass on the negative prompt "" (the pipeline's default):
  v = v_neg + s (v_pos - v_neg);
- the noise levels are the flow-matching schedule shifted by the scheduler's shift. Published
  checkpoints ship a UniPC multistep solver (`flow_shift`); our sampler takes Euler and SDE
  steps, so `load_pipeline` puts a `FlowMatchEulerDiscreteScheduler` with the same shift in
  its place: the same flow, integrated on the Euler grid that Flow-GRPO's log-probs need;
- decoded clips are (B, F, 3, H, W) in [0, 1] (`decode_clips`: frame chunks of the whole micro-batch).

Wan2.2's Mixture-of-Experts checkpoints (A14B: a high-noise and a low-noise transformer) are
the `wan22` family's (`omni.models.wan22`); this family refuses them at validation (`check_path`).

The tiny pipeline has every part a real checkpoint has (WanTransformer3DModel, a UMT5 text
encoder with a T5 tokenizer of the tiny vocabulary, an AutoencoderKLWan, a flow-matching
scheduler), built in memory from a seed and loaded with `WanPipeline.from_pretrained` like a
real checkpoint. No hub access.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from omni.models.base import Conditioning, ModelFamily
from omni.models.native import NativePipeline
from omni.models.tiny_parts import TINY_DECODER_GAIN, cached_checkpoint, save_pipeline, t5_tokenizer

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 1

TINY_TEXT_WIDTH = 32
TINY_TEXT_LENGTH = 64
TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=TINY_TEXT_WIDTH,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
)
# Wan2.1 T2V's shift at 480p (its scheduler's flow_shift).
TINY_SHIFT = 3.0
NEGATIVE_PROMPT = ""  # WanPipeline's default negative prompt
TEMPORAL_FACTOR = 4  # every Wan VAE: F frames are (F - 1) / 4 + 1 latent frames


# ----------------------------------------------------------------- tiny checkpoint
def umt5_encoder(tokenizer, seed: int):
    """A 32-wide, two-layer UMT5 encoder (the architecture of umt5-xxl, narrow)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TINY_TEXT_WIDTH,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return UMT5EncoderModel(config)


def wan_vae(seed: int):
    """A narrow AutoencoderKLWan (spatial factor 8, temporal factor 4, 16 channels, the
    published latents_mean / latents_std, its defaults), its decoder's output scaled as the
    other tiny VAEs are."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(TINY_DECODER_GAIN)
    return vae


def build_tiny_wan_pipeline(seed: int = 0):
    """A complete random Wan pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = t5_tokenizer(TINY_TEXT_LENGTH)
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=umt5_encoder(tokenizer, seed + 2),
        vae=wan_vae(seed + 1),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=TINY_SHIFT),
        transformer=transformer,
    )


def write_tiny_wan(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny pipeline and save it to `out_dir` atomically (never half-written)."""
    return save_pipeline(build_tiny_wan_pipeline(seed), out_dir)


def tiny_wan_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(cache_dir, "wan-tiny", TINY_BUILDER_VERSION, seed, lambda path: write_tiny_wan(path, seed))


def euler_scheduler(config: dict):
    """The flow-matching Euler scheduler our sampler steps for a checkpoint's scheduler config
    (with its `_class_name`): the checkpoint's own if it is one, else one of the same shift
    (published checkpoints ship UniPC with a `flow_shift`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if config.get("_class_name") == FlowMatchEulerDiscreteScheduler.__name__:
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    return FlowMatchEulerDiscreteScheduler(shift=float(config.get("flow_shift", 1.0)))


# ----------------------------------------------------------------- conditioning
@dataclass
class WanPromptEmbeds(Conditioning):
    """UMT5's hidden states per prompt, zero past its tokens, `max_sequence_length` long; the
    negative prompt's under CFG."""

    embeds: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None


class WanNative(NativePipeline):
    """vLLM-Omni's Wan pipeline (Wan2.1 and Wan2.2 TI2V text-to-video, one transformer) under
    `rollout.options.backend=native`. Its transformer's names: the self-attention's q/k/v fused
    into `to_qkv`, the cross-attention's apart, `to_out`, the feed-forward layers and the output
    `scale_shift_table` renamed. Its scheduler: vLLM-Omni builds a UniPC solver (or an Euler one
    for `sample_solver=euler`) of the engine's `flow_shift`, and rebuilds it when a request asks
    for another; `prepare` sets its loop to the Euler path (`set_timesteps(n)`, no rebuild) and
    puts the checkpoint's own Euler scheduler, as `WanFamily.load_pipeline` does, in place for
    `FlowGRPOScheduler`, so the noise levels are the trained family's whatever the engine's
    `flow_shift`."""

    pipeline = "vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2.Wan22Pipeline"
    hooks = ("diffuse", "forward", "scheduler_step", "load_weights", "encode_prompt")
    # the self-attention's q/k/v fused; the cross-attention's (attn2) kept apart
    fused = {f"attn1.{p}": ("to_qkv", p[-1]) for p in ("to_q", "to_k", "to_v")}
    renamed = (("to_out.0", "to_out"), ("ffn.net.0", "ffn.net_0"), ("ffn.net.2", "ffn.net_2"))
    renamed_parameters = (("scale_shift_table", "output_scale_shift_prepare.scale_shift_table"),)
    cond_arguments = ("prompt_embeds", "negative_prompt_embeds")

    def prepare(self, pipe) -> None:
        config = json.loads((Path(pipe.od_config.model) / "scheduler" / "scheduler_config.json").read_text())
        pipe._sample_solver = "euler"
        pipe.scheduler = euler_scheduler(config)

    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        return sigmas * 1000  # Wan's transformer takes t = 1000 sigma

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts, guidance_scale: float, max_sequence_length: int):
        """From vLLM-Omni's UMT5 (zero past each prompt's tokens, as ours; negatives: "")."""
        embeds, negatives = pipe.encode_prompt(
            prompt=list(prompts),
            negative_prompt=NEGATIVE_PROMPT,
            do_classifier_free_guidance=guidance_scale > 1,
            max_sequence_length=max_sequence_length,
        )
        return pipe.family.conditioning(embeds, negatives).apply(lambda t: t.cpu())

    def transformer_problem(self, config: dict) -> Optional[str]:
        """vLLM-Omni's rotary embedding builds its tables over a head's channels split (frames,
        height, width) as diffusers does, (d - 4 (d // 6), 2 (d // 6), 2 (d // 6)), but applies
        them split (d - 2 (d // 3), d // 3, d // 3): the same split only where d // 3 is even,
        as for every published Wan (d = 128); the tiny Wan's d = 16 is not (8/4/4 against 6/5/5)."""
        d = config["attention_head_dim"]
        if d // 3 == 2 * (d // 6):
            return None
        return (
            f"attention_head_dim={d}: vLLM-Omni's Wan applies its rotary tables split ({d - 2 * (d // 3)}, {d // 3}, "
            f"{d // 3}) but builds them ({d - 4 * (d // 6)}, {2 * (d // 6)}, {2 * (d // 6)}), so its velocity is not "
            "the trained transformer's (heads of 128 channels, every published Wan, agree)"
        )


class WanFamily(ModelFamily):
    name = "wan"
    pipeline_class = "WanPipeline"
    transformer_class = "WanTransformer3DModel"
    conditioning = WanPromptEmbeds
    video = True
    layer_prefixes = ("blocks.",)
    # Self- (attn1) and cross-attention (attn2) projections of every block.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoders = ("text_encoder",)
    native = WanNative()
    published_configs = {
        "wan2.1-t2v-1.3b": "wan2.1-t2v-1.3b-transformer.json",
        "wan2.1-t2v-14b": "wan2.1-t2v-14b-transformer.json",
        "wan2.2-ti2v-5b": "wan2.2-ti2v-5b-transformer.json",
    }
    # umt5-xxl's encoder and Wan2.1's VAE, counted from their published configs on the meta
    # device (tests/models/test_wan.py recounts them).
    text_encoder_params = 5_680_910_336
    vae_params = 126_892_531

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_wan_path(cache_dir, seed)

    def tiny_transformer_config(self) -> dict:
        return dict(TINY_TRANSFORMER)

    def tiny_resolution_multiple(self) -> int:
        return 8 * TINY_TRANSFORMER["patch_size"][1]

    def check_path(self, path: Optional[str], key: str = "model.path") -> Path:
        """A diffusers Wan checkpoint with one transformer: Wan2.2 A14B's two experts are model=wan22's."""
        root = super().check_path(path, key)
        index = json.loads((root / "model_index.json").read_text())
        if (index.get("transformer_2") or [None])[0] is not None or index.get("boundary_ratio") is not None:
            raise ValueError(
                f"{key}={path}: a Wan2.2 Mixture-of-Experts checkpoint (transformer and transformer_2, switched at "
                f"boundary_ratio={index.get('boundary_ratio')}): train it with model=wan22 (model.family=wan22); "
                "model=wan takes a single-transformer checkpoint (Wan2.1 T2V 1.3B / 14B, Wan2.2 TI2V-5B)"
            )
        return root

    def resolution_multiple(self, path) -> int:
        """The VAE's spatial factor times the transformer's spatial patch."""
        root = Path(path).expanduser()
        vae = json.loads((root / "vae" / "config.json").read_text())
        patch = json.loads((root / "transformer" / "config.json").read_text())["patch_size"]
        return int(vae.get("scale_factor_spatial") or 8) * int(patch[1])

    def sequence_length(
        self, transformer_config: dict, resolution, max_sequence_length: int, num_frames: int = 81
    ) -> int:
        """Video tokens a block's self-attention attends over (the text enters by cross-attention),
        for `num_frames` frames of `resolution` pixels square, or (height, width)."""
        spatial = 16 if transformer_config["in_channels"] == 48 else 8  # Wan2.2's 48-channel VAE has factor 16
        _, p_h, p_w = transformer_config["patch_size"]
        height, width = resolution if isinstance(resolution, (tuple, list)) else (resolution, resolution)
        frames = (num_frames - 1) // TEMPORAL_FACTOR + 1
        return frames * (height // (spatial * p_h)) * (width // (spatial * p_w))

    def forward_passes(self, guidance_scale: float) -> int:
        return 2 if guidance_scale > 1 else 1

    def pipeline_guidance(self, guidance_scale: float) -> dict:
        """CFG on the negative prompt "", as our sampler runs it."""
        return {"guidance_scale": guidance_scale, "negative_prompt": NEGATIVE_PROMPT}

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        if model.vae_inversion_steps:
            raise ValueError(
                f"model.vae_inversion_steps={model.vae_inversion_steps}: Wan's videos are encoded by its VAE's "
                "encoder (set 0)"
            )
        frames = rollout.num_frames
        if frames < 1 or (frames - 1) % TEMPORAL_FACTOR:
            raise ValueError(
                f"rollout.num_frames={frames}: Wan's VAE takes {TEMPORAL_FACTOR}k+1 frames (1, 5, 9, ..., 81); "
                f"the nearest are {max(1, frames - (frames - 1) % TEMPORAL_FACTOR)} and "
                f"{frames - (frames - 1) % TEMPORAL_FACTOR + TEMPORAL_FACTOR}"
            )

    # ----------------------------------------------------------------- loading
    def load_pipeline(self, path, dtype: torch.dtype, load_base: bool = True, without_transformer: bool = False):
        """The pipeline (see `ModelFamily.load_pipeline`), its scheduler the Euler one of the
        checkpoint's shift (the module docstring says why)."""
        pipe = super().load_pipeline(path, dtype, load_base, without_transformer)
        pipe.scheduler = euler_scheduler({"_class_name": type(pipe.scheduler).__name__, **pipe.scheduler.config})
        return pipe

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> WanPromptEmbeds:
        """The prompts' (and under CFG, the negative prompt's) UMT5 states, zero-padded."""
        with torch.no_grad():
            embeds, neg = pipe.encode_prompt(
                prompt=list(prompts),
                negative_prompt=NEGATIVE_PROMPT,
                do_classifier_free_guidance=guidance_scale > 1,
                max_sequence_length=max_sequence_length,
                device=device,
            )
        return WanPromptEmbeds(embeds, neg)

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        """Noise (B, C, (F - 1) / 4 + 1, H / 8, W / 8) of the VAE's C channels (an image-to-video
        transformer takes more: its condition's), one clip per generator."""
        channels = pipe.vae.config.z_dim
        frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        size = resolution // pipe.vae_scale_factor_spatial
        return torch.stack([torch.randn(channels, frames, size, size, generator=g) for g in generators])

    # Timesteps are sigma x 1000 in fp32, as the pipeline's scheduler gives them.
    def velocity_pass(self, transformer, latents, sigmas, cond: WanPromptEmbeds, negative: bool = False):
        embeds = cond.neg_embeds if negative else cond.embeds
        return transformer(
            hidden_states=latents, timestep=sigmas.float() * 1000, encoder_hidden_states=embeds, return_dict=False
        )[0].float()

    def both_passes(self, transformer, latents, sigmas, cond: WanPromptEmbeds):
        """The prompts and the negative prompt in one batch."""
        timesteps = sigmas.float() * 1000
        out = transformer(
            hidden_states=torch.cat([latents, latents]),
            timestep=torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([cond.embeds, cond.neg_embeds]),
            return_dict=False,
        )[0]
        text, uncond = out.float().chunk(2)
        return text, uncond

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        return decode_clips(pipe.vae, latents)

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Clips (B, F, 3, H, W) in [0, 1] -> normalised latents (the posterior's mode), fp32 CPU."""
        vae = pipe.vae
        with torch.no_grad():
            latents = vae.encode((images * 2 - 1).transpose(1, 2).to(device, vae.dtype)).latent_dist.mode().float()
        mean, std = latent_stats(vae, latents.device, latents.dtype)
        return ((latents - mean) / std).cpu()


def latent_stats(vae, device, dtype):
    """The VAE's per-channel latents_mean and latents_std, shaped (1, C, 1, 1, 1)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(device, dtype)
    return mean, std


@torch.no_grad()
def decode_clips(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, f, h, w) -> clips (B, F, 3, H, W) in [0, 1], fp32 on the CPU.

    The Wan VAE's decoder is causal in time: `AutoencoderKLWan.decode` feeds it one latent
    frame at a time (1 frame of pixels for the first, 4 for each next) with a cache of the
    previous frames' activations, but keeps the whole clips' pixels on the device until the
    end. Here the same loop runs over the whole batch (a micro-batch: the cache holds a row
    per clip) and moves each chunk's pixels to the CPU as soon as it is decoded, so device
    memory holds the batch's cache and one chunk of each clip, whatever the clips' length;
    the pixels are those of `vae.decode` (tests/models/test_wan.py)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    mean, std = latent_stats(vae, latents.device, vae.dtype)
    z = latents.to(vae.dtype) / (1.0 / std) + mean  # as the pipeline writes it
    chunks = []
    vae.clear_cache()
    try:
        for i in range(z.shape[2]):
            vae._conv_idx = [0]
            x = vae.post_quant_conv(z[:, :, i : i + 1])  # a 1x1x1 convolution: frame by frame is exact
            out = vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
            if vae.config.patch_size is not None:
                out = unpatchify(out, patch_size=vae.config.patch_size)
            chunks.append((out.float().clamp(-1, 1) / 2 + 0.5).transpose(1, 2).cpu())
    finally:
        vae.clear_cache()
    return torch.cat(chunks, 1)


FAMILY = WanFamily()
