"""Tiny random CLIP models saved to disk the way real checkpoints are (config, safetensors,
tokenizer and image processor), so the CLIP rewards run their real loading code offline."""

from __future__ import annotations

from pathlib import Path

import torch


def byte_level_vocab():
    """A CLIP BPE vocabulary with no merges: every byte, alone and word-final, plus the specials."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        vocab.update({char + suffix: len(vocab) + i for i, char in enumerate(alphabet)})
    return vocab


def build_tiny_clip(directory: Path, seed: int = 0, projection_dim: int = 16) -> Path:
    """A 2-layer CLIP (32-d, 32 x 32 images, patches of 8) and its processor in `directory`."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = byte_level_vocab()
    tower = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=projection_dim
    )
    text = dict(
        tower, vocab_size=len(vocab), max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1
    )
    config = CLIPConfig(
        text_config=text, vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=projection_dim
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(directory)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    return directory


def save_aesthetic_head(path: Path, embedding_size: int, seed: int = 0, constant: float | None = None) -> Path:
    """A random aesthetic MLP head (or one that always answers `constant`) as a .pth state dict."""
    from omni.rewards.aesthetic import AestheticHead

    torch.manual_seed(seed)
    head = AestheticHead(embedding_size)
    if constant is not None:
        torch.nn.init.zeros_(head.layers[7].weight)
        torch.nn.init.constant_(head.layers[7].bias, constant)
    torch.save(head.state_dict(), path)
    return path
