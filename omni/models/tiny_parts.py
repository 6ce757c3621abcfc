"""Parts of the tiny random checkpoints that several model families share: CLIP and T5
tokenizers with a small written-out vocabulary, their encoders, and a small AutoencoderKL.

Everything is built in memory from a seed (no hub access) and is identical for identical
seeds on any machine, so a family's tiny builder (`omni/models/<family>.py`) only chooses
sizes and assembles its pipeline from these parts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import torch

from omni.atomic import write_directory

TINY_WORDS = (
    "a an the of in on with and photo painting picture of "
    "red green blue yellow white black orange purple pink gray "
    "cat dog square circle car house tree flower bird apple sky sea"
).split()
ALPHABET = [chr(c) for c in range(33, 127)]
# A random decoder maps every latent to nearly the same grey; a larger output layer spreads
# images over the pixel range, as a trained decoder does.
TINY_DECODER_GAIN = 4.0
# Four VAE levels: a 64 px image is an 8x8 latent.
TINY_VAE_CHANNELS = (8, 8, 16, 16)
TINY_VAE_FACTOR = 2 ** (len(TINY_VAE_CHANNELS) - 1)


def clip_vocabulary(words=TINY_WORDS):
    """CLIP's BPE vocabulary and merges for the tiny words, written out rather than trained
    (a trained BPE breaks ties between equally frequent pairs differently from one process
    to the next, which would make the "same seed" model differ). Every character also has a
    `</w>` form, so no text falls back to the unknown token (which CLIP shares with eos,
    where it pools); each of `words` is merged left to right into one token."""
    vocab = ["<|startoftext|>", "<|endoftext|>"] + ALPHABET + [c + "</w>" for c in ALPHABET]
    merges = []
    for word in sorted(set(words)):
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            if pair not in merges:
                merges.append(pair)
                vocab.append(pair[0] + pair[1])
            symbols = [pair[0] + pair[1]] + symbols[2:]
    return {token: i for i, token in enumerate(dict.fromkeys(vocab))}, merges


def clip_tokenizer(max_length: int, words=TINY_WORDS):
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocabulary(words)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(max_length: int, words=TINY_WORDS):
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    vocab += [("\u2581" + w, -1.0) for w in dict.fromkeys(words)]
    vocab += [(c, -5.0) for c in ALPHABET]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def clip_encoder(tokenizer, seed: int, with_projection: bool = True):
    """A 32-wide CLIP text encoder (`CLIPTextModelWithProjection`, or `CLIPTextModel` whose
    pooled output a pipeline uses directly)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

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
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def t5_encoder(tokenizer, seed: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config)


def autoencoder_kl(seed: int, latent_channels: int, shift_factor: float, scaling_factor: float):
    """A four-level AutoencoderKL (factor `TINY_VAE_FACTOR`) with its decoder's output
    layer scaled by `TINY_DECODER_GAIN`."""
    from diffusers import AutoencoderKL

    channels = TINY_VAE_CHANNELS
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(TINY_DECODER_GAIN)
    return vae


def save_pipeline(pipe, out_dir: str | os.PathLike) -> Path:
    """Save a built tiny pipeline to `out_dir` atomically (never half-written)."""
    return write_directory(Path(out_dir), lambda tmp: pipe.save_pretrained(tmp, safe_serialization=True))


def cached_checkpoint(
    cache_dir: str | os.PathLike, name: str, version: int, seed: int, write: Callable[[Path], Path]
) -> Path:
    """Directory of the cached tiny checkpoint `name` ("sd3-tiny", ...) for `seed`, written by
    `write(path)` on first use. The builder `version` is part of the key, so a changed
    builder never reuses an older build."""
    key = hashlib.sha1(f"{name}-v{version}-seed{seed}".encode()).hexdigest()[:10]
    path = Path(cache_dir).expanduser() / f"{name.replace('-', '_')}-{key}"
    if not (path / "model_index.json").exists():
        write(path)
    return path
