"""Stable Diffusion 3: loading real checkpoints and building a tiny random one offline.

The tiny pipeline has every part a real SD3 checkpoint has (MMDiT transformer, two CLIP
text encoders with projection, a T5 encoder, a VAE, the flow-matching scheduler and real
tokenizer classes), built in memory from a seed, saved to a directory and then loaded with
`StableDiffusion3Pipeline.from_pretrained` like any real checkpoint. No hub access.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Sequence

import torch

from omni.atomic import write_directory

LAYER_PREFIXES = ("transformer_blocks.",)

# Bump when the tiny architecture changes, so stale caches are not reused.
TINY_BUILDER_VERSION = 3

_TINY_WORDS = (
    "a an the of in on with and photo painting picture of "
    "red green blue yellow white black orange purple pink gray "
    "cat dog square circle car house tree flower bird apple sky sea"
).split()
_ALPHABET = [chr(c) for c in range(33, 127)]

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
TINY_DECODER_GAIN = 4.0


def tiny_transformer_config(**overrides) -> dict:
    """Config of the tiny SD3 transformer (also used alone by the FSDP tests)."""
    return {**TINY_TRANSFORMER, **overrides}


def build_tiny_transformer(seed: int = 0, **overrides):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(**tiny_transformer_config(**overrides))


def _clip_tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=256,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=_ALPHABET,
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    # every character also stands alone as a word, so each has a `</w>` form and no text
    # falls back to the unknown token (which CLIP shares with eos, where it pools)
    bpe.train_from_iterator([" ".join(_TINY_WORDS)] * 4 + [" ".join(_ALPHABET)], trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    return CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=max_length)


def _t5_tokenizer(max_length: int):
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    vocab += [("\u2581" + w, -1.0) for w in dict.fromkeys(_TINY_WORDS)]
    vocab += [(c, -5.0) for c in _ALPHABET]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _clip_encoder(tokenizer, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config)


def _t5_encoder(tokenizer, seed: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=TINY_TRANSFORMER["joint_attention_dim"],
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config)


def _vae(seed: int):
    from diffusers import AutoencoderKL

    channels = (8, 8, 16, 16)  # four levels: a 64 px image is an 8x8 latent
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=TINY_TRANSFORMER["in_channels"],
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5305,
    )
    # A random decoder maps every latent to nearly the same grey; a larger output layer
    # spreads images over the pixel range, as a trained decoder does.
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(TINY_DECODER_GAIN)
    return vae


def build_tiny_sd3_pipeline(seed: int = 0):
    """A complete random SD3 pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    clip_tok = _clip_tokenizer(TINY_TEXT_LENGTH)
    t5_tok = _t5_tokenizer(TINY_TEXT_LENGTH)
    return StableDiffusion3Pipeline(
        transformer=build_tiny_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(seed + 1),
        text_encoder=_clip_encoder(clip_tok, seed + 2),
        tokenizer=clip_tok,
        text_encoder_2=_clip_encoder(clip_tok, seed + 3),
        tokenizer_2=_clip_tokenizer(TINY_TEXT_LENGTH),
        text_encoder_3=_t5_encoder(t5_tok, seed + 4),
        tokenizer_3=t5_tok,
    )


def write_tiny_sd3(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny pipeline and save it to `out_dir` atomically (never half-written)."""
    pipe = build_tiny_sd3_pipeline(seed)
    return write_directory(Path(out_dir), lambda tmp: pipe.save_pretrained(tmp, safe_serialization=True))


def tiny_sd3_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny pipeline for `seed`, built on first use."""
    key = hashlib.sha1(f"sd3-tiny-v{TINY_BUILDER_VERSION}-seed{seed}".encode()).hexdigest()[:10]
    path = Path(cache_dir).expanduser() / f"sd3_tiny-{key}"
    if not (path / "model_index.json").exists():
        write_tiny_sd3(path, seed)
    return path


def check_pretrained_dir(path: str | None, key: str = "model.path") -> Path:
    """Fail early, naming the config key, when a checkpoint directory is unusable."""
    if not path:
        raise ValueError(f"{key} is not set: pass {key}=/path/to/a/diffusers/checkpoint")
    p = Path(path).expanduser()
    if not (p / "model_index.json").is_file():
        raise FileNotFoundError(
            f"{key}={path}: no diffusers checkpoint there (model_index.json missing); "
            f"pass {key}=/path/to/a/local/diffusers/checkpoint directory"
        )
    return p


def load_sd3_pipeline(path: str | os.PathLike, dtype: torch.dtype = torch.float32, **components):
    """Load a diffusers SD3 checkpoint directory (real or tiny) offline; `components`
    replace parts of it (e.g. a transformer to be filled by a weight sync)."""
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True, **components)


def encode_prompts(pipe, prompts, guidance_scale: float, max_sequence_length: int, device):
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


@dataclass
class PromptEmbeds:
    """SD3's two text conditions per prompt (sequence and pooled), with CFG negatives."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    neg_embeds: Optional[torch.Tensor] = None
    neg_pooled: Optional[torch.Tensor] = None

    @staticmethod
    def cat(parts: "Sequence[PromptEmbeds]") -> "PromptEmbeds":
        """The embeddings of several batches, one after the other."""
        per_field = ([getattr(p, f.name) for p in parts] for f in fields(PromptEmbeds))
        return PromptEmbeds(*(None if tensors[0] is None else torch.cat(tensors) for tensors in per_field))

    def apply(self, fn) -> "PromptEmbeds":
        """A copy with `fn` applied to every tensor present (indexing, moving, ...)."""
        return PromptEmbeds(*(None if t is None else fn(t) for t in (getattr(self, f.name) for f in fields(self))))


def predict_velocity(transformer, latents, sigmas, cond: PromptEmbeds, guidance_scale: float):
    """The transformer's velocity at noise levels `sigmas` (one per sample), with
    classifier-free guidance when guidance_scale > 1 (negatives and positives in one pass)."""
    timesteps = sigmas.to(latents.dtype) * 1000
    if guidance_scale > 1:
        out = transformer(
            hidden_states=torch.cat([latents, latents]),
            timestep=torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([cond.neg_embeds, cond.embeds]),
            pooled_projections=torch.cat([cond.neg_pooled, cond.pooled]),
            return_dict=False,
        )[0]
        uncond, text = out.chunk(2)
        return uncond + guidance_scale * (text - uncond)
    return transformer(
        hidden_states=latents,
        timestep=timesteps,
        encoder_hidden_states=cond.embeds,
        pooled_projections=cond.pooled,
        return_dict=False,
    )[0]


def decode_latents(vae, latents, dtype: torch.dtype):
    """Latents -> images in [0, 1] (`dtype`: the VAE's, passed in because reading it is slow)."""
    with torch.no_grad():
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)
