"""Qwen-Image as a model family: a tiny random checkpoint built offline, Qwen2.5-VL's text
conditioning (the last hidden states of a chat-templated prompt, the template dropped, with a
padding mask), packed latents, the resolution-dependent timestep shift, true classifier-free
guidance with its norm-preserving rescale, the 3-D VAE's per-channel normalisation, and LoRA
export for `QwenImagePipeline.load_lora_weights`.

Sampling follows `QwenImagePipeline.__call__`:
- a prompt is wrapped in the pipeline's chat template; the text encoder's last hidden states
  of the prompt's own tokens are kept, the template's first `prompt_template_encode_start_idx`
  tokens (its system message) dropped, at most `max_sequence_length` of them, with a mask
  marking real tokens. We keep every row padded to `max_sequence_length` (so rows encoded
  apart stack) and cut a batch to its longest prompt before the transformer, as the pipeline
  does (no mask at all when no row is padded);
- latents are 16-channel single-frame latents of the 3-D VAE, cut into 2x2 patches and packed
  into 64-wide tokens; the transformer takes the token grid (`img_shapes`) for its RoPE;
- the noise levels are `linspace(1, 1/n, n)` shifted by exp(mu), mu linear in the number of
  image tokens (the scheduler's dynamic shift, then its stretch to `shift_terminal`);
- guidance is true CFG (`rollout.guidance_scale` is the pipeline's `true_cfg_scale`): a
  second pass on the negative prompt " ", v = neg + s (pos - neg), rescaled per token to the
  conditional velocity's norm;
- the VAE's latents are normalised per channel by `latents_mean` / `latents_std`.

The tiny pipeline has every part a real checkpoint has (QwenImageTransformer2DModel, a
Qwen2_5_VLForConditionalGeneration text encoder with a byte-level BPE `Qwen2Tokenizer`, an
AutoencoderKLQwenImage, Qwen-Image's scheduler config), built in memory from a seed and loaded
with `QwenImagePipeline.from_pretrained` like a real checkpoint. No hub access.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from omni.models.base import Conditioning, ModelFamily
from omni.models.native import NativePipeline, packed_step_noise
from omni.models.packing import pack, packed_noise, shifted_sigmas, unpack
from omni.models.tiny_parts import TINY_DECODER_GAIN, TINY_WORDS, cached_checkpoint, save_pipeline

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 1

TINY_TEXT_WIDTH = 32
TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,  # 16 VAE channels x a 2x2 patch
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TINY_TEXT_WIDTH,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
# Qwen-Image's scheduler/scheduler_config.json (Qwen/Qwen-Image).
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)
# The prompt context QwenImagePipeline accepts, and the negative prompt under true CFG
# (the pipeline's docs: "even an empty negative prompt like ' '").
MAX_SEQUENCE_LENGTH = 1024
NEGATIVE_PROMPT = " "
# The words of QwenImagePipeline's chat template, each one token of the tiny tokenizer, so the
# template's system part is as many tokens as with Qwen's own (the pipeline drops a fixed count).
TEMPLATE_WORDS = (
    "system Describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background user assistant"
).split()
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


# ----------------------------------------------------------------- tiny tokenizer
def byte_alphabet() -> List[str]:
    """Byte-level BPE's printable stand-in for each of the 256 bytes (GPT-2's mapping)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def bpe(symbols: List[str], ranks: dict) -> List[str]:
    """Byte-pair encoding of one word: merge the best-ranked adjacent pair until none applies."""
    while len(symbols) > 1:
        pairs = [(ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == math.inf:
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
    return symbols


def qwen_vocabulary(template_words=TEMPLATE_WORDS):
    """Vocabulary and merges written out (never trained, so identical in every process): the
    256 byte symbols, then every tiny and template word, bare and after a space (`Ġ`), given
    the merges that make it one token after the merges before it."""
    alphabet = byte_alphabet()
    space = alphabet[ord(" ")]
    vocab, ranks = list(alphabet), {}
    for word in dict.fromkeys(list(template_words) + TINY_WORDS):
        for form in (word, space + word):
            symbols = bpe(list(form), ranks)
            while len(symbols) > 1:
                ranks[(symbols[0], symbols[1])] = len(ranks)
                vocab.append(symbols[0] + symbols[1])
                symbols = bpe(symbols, ranks)
    vocab += SPECIAL_TOKENS
    return {token: i for i, token in enumerate(dict.fromkeys(vocab))}, list(ranks)


def qwen_tokenizer(template_words=TEMPLATE_WORDS):
    """The tiny tokenizer whose words (a pipeline's chat template's) are one token each."""
    from transformers import Qwen2Tokenizer

    vocab, merges = qwen_vocabulary(template_words)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def qwen_text_encoder(tokenizer, seed: int):
    """A 32-wide, two-layer Qwen2.5-VL (a one-block vision tower it never uses for text)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {
        name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
        for name in ("vision_start", "vision_end", "image_pad", "video_pad")
    }
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=TINY_TEXT_WIDTH,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, mrope_section=[2, 3, 3]),
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=TINY_TEXT_WIDTH,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen_vae(seed: int):
    """A narrow AutoencoderKLQwenImage (factor 8, 16 channels, the published per-channel
    latents_mean / latents_std, its defaults), its decoder's output scaled as the other tiny
    VAEs are."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(TINY_DECODER_GAIN)
    return vae


def build_tiny_qwen_image_pipeline(seed: int = 0):
    """A complete random Qwen-Image pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    tokenizer = qwen_tokenizer()
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER)
    return QwenImagePipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=qwen_vae(seed + 1),
        text_encoder=qwen_text_encoder(tokenizer, seed + 2),
        tokenizer=tokenizer,
    )


def write_tiny_qwen_image(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny pipeline and save it to `out_dir` atomically (never half-written)."""
    return save_pipeline(build_tiny_qwen_image_pipeline(seed), out_dir)


def tiny_qwen_image_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir, "qwen-image-tiny", TINY_BUILDER_VERSION, seed, lambda path: write_tiny_qwen_image(path, seed)
    )


# ----------------------------------------------------------------- conditioning
@dataclass
class QwenPromptEmbeds(Conditioning):
    """Qwen-Image's text conditioning per prompt: hidden states padded to a fixed length and
    their mask (1 on real tokens), and the negative prompt's under true CFG."""

    embeds: torch.Tensor
    mask: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_mask: Optional[torch.Tensor] = None


def pad_to(embeds: torch.Tensor, mask: Optional[torch.Tensor], length: int):
    """Embeddings (B, L, D) and mask (B, L) (None: all real) padded with zeros to `length`."""
    b, n, d = embeds.shape
    mask = torch.ones(b, n, dtype=torch.long, device=embeds.device) if mask is None else mask.long()
    padded = embeds.new_zeros(b, length, d)
    padded[:, :n] = embeds
    full = mask.new_zeros(b, length)
    full[:, :n] = mask
    return padded, full


def trim(embeds: torch.Tensor, mask: torch.Tensor):
    """The batch cut to its longest prompt, as the pipeline encodes a batch; no mask when
    every row is full (the pipeline passes None then)."""
    mask = mask.bool()
    longest = int(mask.sum(1).max())
    embeds, mask = embeds[:, :longest], mask[:, :longest]
    return embeds, (None if bool(mask.all()) else mask)


def velocity(transformer, latents, timestep, embeds, mask) -> torch.Tensor:
    embeds, mask = trim(embeds, mask)
    side = math.isqrt(latents.shape[1])
    return transformer(
        hidden_states=latents,
        timestep=timestep,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=[[(1, side, side)]] * latents.shape[0],
        return_dict=False,
    )[0].float()


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's guidance: the CFG combination rescaled, token by token, to the norm
    of the conditional velocity."""
    combined = uncond + scale * (cond - uncond)
    return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageNative(NativePipeline):
    """vLLM-Omni's Qwen-Image pipeline under `rollout.options.backend=native`: its true CFG is
    our combination and norm rescale, run when a request carries the negative prompt " " and
    `true_cfg_scale` (`pipeline_guidance`); its transformer fuses q/k/v as SD3's does and names
    diffusers' `to_out.0` (the first entry of a list) `to_out`."""

    pipeline = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image.QwenImagePipeline"
    renamed = (("to_out.0", "to_out"),)
    cond_arguments = ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask")
    noise = staticmethod(packed_step_noise)
    post_process = "converts_payload"  # its post-process makes PIL images of the payload

    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        return sigmas * 1000 / 1000  # the scheduler's timestep, divided as the pipeline does

    def conditioning(self, family, given, max_sequence_length: int):
        """Each prompt's embeddings and mask padded to `max_sequence_length` (vLLM-Omni pads a
        batch to its longest prompt), so rows of other batches stack."""
        embeds, mask, neg, neg_mask = given.values()
        negatives = pad_to(neg, neg_mask, max_sequence_length) if neg is not None else (None, None)
        return family.conditioning(*pad_to(embeds, mask, max_sequence_length), *negatives)

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts, guidance_scale: float, max_sequence_length: int):
        """The prompts' (and under true CFG the negative prompt's) embeddings and masks from
        vLLM-Omni's text encoder, padded to `max_sequence_length`, as the family encodes them."""

        def padded(texts):
            encoded = pipe.encode_prompt(prompt=texts, max_sequence_length=max_sequence_length)
            return pad_to(*encoded, max_sequence_length)

        negatives = padded([NEGATIVE_PROMPT] * len(prompts)) if guidance_scale > 1 else (None, None)
        return pipe.family.conditioning(*padded(list(prompts)), *negatives).apply(lambda t: t.cpu())


class QwenImageFamily(ModelFamily):
    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    conditioning = QwenPromptEmbeds
    layer_prefixes = ("transformer_blocks.",)
    # Both streams' attention projections (image: to_*, text: add_*_proj, to_add_out).
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    native = QwenImageNative()

    def unused_modules(self, transformer_config: dict) -> List[str]:
        """In the last block, what only the text stream's output depends on (its queries, its
        attention output and feed-forward): the transformer returns only image tokens."""
        last = f"transformer_blocks.{transformer_config['num_layers'] - 1}"
        return [
            f"{last}.{name}" for name in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
        ]

    text_encoders = ("text_encoder",)
    published_configs = {"qwen-image": "qwen-image-transformer.json"}
    # Qwen2.5-VL-7B (language model and vision tower, as the pipeline loads it) and the
    # 3-D VAE, counted from their published configs on the meta device.
    text_encoder_params = 8_292_166_656
    vae_params = 126_892_531

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_qwen_image_path(cache_dir, seed)

    def tiny_transformer_config(self) -> dict:
        return dict(TINY_TRANSFORMER)

    def tiny_resolution_multiple(self) -> int:
        return 8 * 2

    def resolution_multiple(self, path) -> int:
        """The VAE's downsampling (2 per level) times the 2x2 packing."""
        vae = json.loads((Path(path).expanduser() / "vae" / "config.json").read_text())
        return 2 ** len(vae["temperal_downsample"]) * 2

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        return (resolution // 16) ** 2 + max_sequence_length

    def forward_passes(self, guidance_scale: float) -> int:
        return 2 if guidance_scale > 1 else 1

    def pipeline_guidance(self, guidance_scale: float) -> dict:
        """True CFG on the negative prompt " ", as our sampler runs it."""
        return {"true_cfg_scale": guidance_scale, "negative_prompt": " "}

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        if model.vae_inversion_steps:
            raise ValueError(
                f"model.vae_inversion_steps={model.vae_inversion_steps}: Qwen-Image's images are encoded by its "
                "VAE's encoder (set 0)"
            )
        if model.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"model.max_sequence_length={model.max_sequence_length}: Qwen-Image takes at most "
                f"{MAX_SEQUENCE_LENGTH} prompt tokens"
            )

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> QwenPromptEmbeds:
        """The prompts' (and under true CFG, the negative prompt's) embeddings and masks,
        padded to `max_sequence_length`."""
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(
                prompt=list(prompts), device=device, max_sequence_length=max_sequence_length
            )
            embeds, mask = pad_to(embeds, mask, max_sequence_length)
            neg_embeds = neg_mask = None
            if guidance_scale > 1:
                neg, neg_mask = pipe.encode_prompt(
                    prompt=[NEGATIVE_PROMPT], device=device, max_sequence_length=max_sequence_length
                )
                neg_embeds, neg_mask = (
                    t.expand(len(prompts), *t.shape[1:]) for t in pad_to(neg, neg_mask, max_sequence_length)
                )
        return QwenPromptEmbeds(embeds, mask, neg_embeds, neg_mask)

    def sigmas(self, pipe, num_steps: int, resolution: int) -> torch.Tensor:
        """QwenImagePipeline's schedule (`shifted_sigmas`; its scheduler also stretches the
        shifted noise levels to its terminal value)."""
        return shifted_sigmas(pipe, num_steps, resolution)

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        return packed_noise(pipe, generators, resolution)

    # True CFG: two passes, each prompt cut to its batch's longest, as the pipeline runs them.
    def velocity_pass(self, transformer, latents, sigmas, cond: QwenPromptEmbeds, negative: bool = False):
        # the pipeline hands the scheduler's timestep (sigma x 1000, fp32) over divided by 1000
        timestep = sigmas.float() * 1000 / 1000
        embeds, mask = (cond.neg_embeds, cond.neg_mask) if negative else (cond.embeds, cond.mask)
        return velocity(transformer, latents, timestep, embeds, mask)

    def guide(self, text: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        return true_cfg(text, uncond, guidance_scale)

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        return qwen_vae_decode(pipe.vae, unpack(latents))

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Images in [0, 1] -> packed latents (the VAE posterior's mode), fp32 on the CPU.
        The 3-D VAE's decoder is not inverted (`check_settings` refuses inversion steps)."""
        return pack(qwen_vae_encode(pipe.vae, images, device))


def latent_stats(vae, device, dtype):
    """The VAE's per-channel latents_mean and latents_std, shaped (1, C, 1, 1, 1)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(device, dtype)
    return mean, std


@torch.no_grad()
def qwen_vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, h, w) -> images (B, 3, H, W) in [0, 1], fp32."""
    latents = latents[:, :, None].to(vae.dtype)
    mean, std = latent_stats(vae, latents.device, latents.dtype)
    # as the pipeline writes it: divided by 1/std
    images = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0][:, :, 0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def qwen_vae_encode(vae, images: torch.Tensor, device) -> torch.Tensor:
    """Images in [0, 1] -> the VAE posterior's mode, normalised per channel, (B, C, h, w) fp32 on the CPU."""
    latents = vae.encode((images * 2 - 1)[:, :, None].to(device, vae.dtype)).latent_dist.mode().float()
    mean, std = latent_stats(vae, latents.device, latents.dtype)
    return ((latents - mean) / std)[:, :, 0].cpu()


FAMILY = QwenImageFamily()
