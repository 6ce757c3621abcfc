"""What is SD3's own beyond the family contract (tests/models/test_family_contract.py): the cached
tiny build reused, CLIP tokenizers that keep eos apart from unknown text, real SD3 text lengths,
a bf16 pipeline with an fp32 VAE, and SD3.5's published VAE and scheduler."""

import pytest
import torch

from omni.models import get_family
from omni.models.sd3 import FAMILY, tiny_sd3_path

COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def test_cache_is_reused(tiny_cache, tiny_sd3_dir):
    stamp = (tiny_sd3_dir / "model_index.json").stat().st_mtime_ns
    assert tiny_sd3_path(tiny_cache, seed=0) == tiny_sd3_dir
    assert (tiny_sd3_dir / "model_index.json").stat().st_mtime_ns == stamp


def test_tokenizers_keep_eos_distinct_from_unknown_text(tiny_sd3_dir):
    pipe = FAMILY.load_pipeline(tiny_sd3_dir, torch.float32)
    ids = pipe.tokenizer("a red zebra!").input_ids
    # CLIP pools at the first eos: unseen words must not be encoded as eos
    assert ids.count(pipe.tokenizer.eos_token_id) == 1 and ids[-1] == pipe.tokenizer.eos_token_id


def test_family_is_found_by_its_config_name():
    assert get_family("sd3") is FAMILY
    with pytest.raises(KeyError, match="model.family=sd4.*available.*sd3"):
        get_family("sd4")


def test_a_bf16_pipeline_keeps_its_vae_in_fp32(tiny_sd3_dir):
    pipe = FAMILY.load_pipeline(tiny_sd3_dir, torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.float32
    latents = torch.randn(1, 4, 8, 8, dtype=torch.bfloat16)
    images = FAMILY.decode(pipe, latents, 64)
    assert images.dtype == torch.float32 and images.shape == (1, 3, 64, 64)
    assert FAMILY.encode_images(pipe, images, "cpu").shape == (1, 4, 8, 8)


def test_conditional_cfg_gradient_leaves_out_the_unconditional_pass(tiny_sd3_dir):
    from tests.models.cfg_gradient import assert_unconditional_pass_not_differentiated

    pipe = FAMILY.load_pipeline(tiny_sd3_dir, torch.float32)
    cond = FAMILY.encode_prompts(pipe, ["a red cat", "a blue dog"], 4.0, 16, "cpu")
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert_unconditional_pass_not_differentiated(FAMILY, pipe.transformer, latents, torch.tensor([0.9, 0.4]), cond, 4.0)


def test_text_lengths_of_real_sd3_can_be_built():
    """CLIP of 77 tokens as real SD3 has (positions included) and T5 of 128: the joint text
    sequence is their sum, as the pipeline encodes it."""
    from omni.models.sd3 import build_tiny_sd3_pipeline

    pipe = build_tiny_sd3_pipeline(seed=0, clip_length=77, t5_length=128)
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == 77
    assert pipe.text_encoder.config.max_position_embeddings == pipe.text_encoder_2.config.max_position_embeddings == 77
    cond = FAMILY.encode_prompts(pipe, ["a red cat"], guidance_scale=4.5, max_sequence_length=128, device="cpu")
    assert cond.embeds.shape[1] == cond.neg_embeds.shape[1] == 77 + 128


def test_published_vae_and_scheduler():
    """SD3.5's shipped VAE config is the family's VAE (its weight count, 16 channels as the
    published transformers take); the scheduler is SD3.5's (shift 3)."""
    import json
    from importlib import resources

    from diffusers import AutoencoderKL

    from omni.memory import arch_config

    with torch.device("meta"):
        vae = AutoencoderKL.from_config(
            json.loads((resources.files("omni") / "models" / "configs" / FAMILY.published_vae_config).read_text())
        )
    assert sum(p.numel() for p in vae.parameters()) == FAMILY.vae_params and vae.config.scaling_factor == 1.5305
    for arch in FAMILY.published_configs:
        assert vae.config.latent_channels == arch_config(FAMILY, arch)["in_channels"]
        assert FAMILY.published_scheduler_config(arch_config(FAMILY, arch)) == {"shift": 3.0}
