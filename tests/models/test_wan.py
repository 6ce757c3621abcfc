"""What is Wan's own beyond the family contract (tests/models/test_family_contract.py): our
sampler's ODE clips equal to `WanPipeline.__call__`'s from 5-D latents as its own (and not with
another shift), the decoding in frame chunks equal to the VAE's whole decoding, the published
architectures' sizes (a Wan2.2 two-expert checkpoint is the wan22 family's: tests/models/test_wan22.py)."""

import json

import pytest
import torch

from omni.models import get_family
from omni.models.wan import FAMILY, decode_clips, latent_stats, tiny_wan_path
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout

PROMPTS = ["a red cat", "a blue dog with a tree"]
FRAMES, SIZE = 5, 32


@pytest.fixture(scope="module")
def pipe(tiny_wan_dir):
    pipe = FAMILY.load_pipeline(tiny_wan_dir, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_family_and_cache(tiny_cache, tiny_wan_dir):
    assert get_family("wan") is FAMILY and FAMILY.video
    assert tiny_wan_path(tiny_cache, seed=0) == tiny_wan_dir
    assert FAMILY.tiny_resolution_multiple() == FAMILY.resolution_multiple(tiny_wan_dir) == 16


def ode_sample(pipe, guidance_scale, steps=3, seeds=(3, 4)):
    """Our sampler with every step an ODE step."""
    options = SamplingOptions(
        steps, SIZE, guidance_scale, 0.7, max_sequence_length=16, sde_steps=(0, 0), num_frames=FRAMES
    )
    return sample_rollout(FAMILY, pipe, PROMPTS, list(seeds), options, 4, torch.device("cpu"), torch.float32)


def pipeline_clips(pipe, latents, guidance_scale, steps=3):
    return pipe(
        PROMPTS, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=steps, max_sequence_length=16,
        latents=latents.clone(), output_type="pt", **FAMILY.pipeline_guidance(guidance_scale),
    ).frames  # fmt: skip


def test_ode_sampling_equals_wan_pipeline(pipe, monkeypatch):
    """CFG at 4 on the negative prompt "": the pipeline's clips (B, F, 3, H, W), from the same
    5-D initial latents as its own for the same generators; another shift gives other clips."""
    ours = ode_sample(pipe, 4.0)
    theirs = pipeline_clips(pipe, ours.latents[:, 0], 4.0)
    assert ours.latents.shape == (2, 4, 16, (FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8)
    assert ours.images.shape == theirs.shape == (2, FRAMES, 3, SIZE, SIZE) and theirs.std() > 0.05
    assert (ours.images - theirs).abs().max() < 1e-5
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    assert torch.equal(
        ours.latents[:, 0], pipe.prepare_latents(2, 16, SIZE, SIZE, FRAMES, torch.float32, "cpu", generators)
    )

    sigmas = FAMILY.sigmas
    monkeypatch.setattr(FAMILY, "sigmas", lambda p, n, resolution: sigmas(p, n + 1, resolution)[[0, 1, 2, 4]])
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() > 1e-3


def test_without_guidance_one_pass_runs(pipe):
    """The equality itself is the family contract's; here, no negative pass and other clips."""
    ours = ode_sample(pipe, 1.0)
    assert ours.cond.neg_embeds is None and ours.cond.embeds.shape == (2, 16, 32)
    assert (ours.images - ode_sample(pipe, 4.0).images).abs().max() > 1e-3


def test_chunked_decoding_equals_the_vae_decoding_the_whole_batch(pipe):
    """Frame chunks of a batch of 3 clips at once, moved to the CPU as they come: the pixels of
    `vae.decode` on the whole batch (which keeps the causal cache across chunks as we do), and
    each clip's pixels those it has decoded alone (the batch's rows do not mix); a chunk
    decoded without the previous chunks' cache differs."""
    vae = pipe.vae
    latents = torch.randn(3, 16, 3, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(0))
    mean, std = latent_stats(vae, "cpu", torch.float32)
    with torch.no_grad():
        whole = vae.decode(latents / (1.0 / std) + mean, return_dict=False)[0]
    whole = (whole / 2 + 0.5).clamp(0, 1).transpose(1, 2)
    chunked = decode_clips(vae, latents)
    assert chunked.shape == (3, 9, 3, SIZE, SIZE) and chunked.device.type == "cpu"
    assert (chunked - whole).abs().max() < 1e-5
    assert (decode_clips(vae, latents[1:2]) - chunked[1:2]).abs().max() < 1e-5
    assert (chunked[0] - chunked[1]).abs().max() > 1e-3
    last_alone = decode_clips(vae, latents[:, :, 1:])  # its last chunk decoded with a cache of one chunk, not two
    assert (last_alone[:, 1:] - whole[:, 5:]).abs().max() > 1e-3


def test_published_architectures_build_on_the_meta_device():
    """The shipped configs are the published sizes (1.42B, 14.3B, 5.0B parameters); the text
    encoder and VAE counts are umt5-xxl's encoder and Wan2.1's VAE."""
    from importlib import resources

    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    counts = {}
    for name, file in FAMILY.published_configs.items():
        config = json.loads((resources.files("omni") / "models" / "configs" / file).read_text())
        counts[name] = sum(p.numel() for p in FAMILY.meta_transformer(config=config).parameters())
    assert round(counts["wan2.1-t2v-1.3b"] / 1e9, 2) == 1.42
    assert round(counts["wan2.1-t2v-14b"] / 1e9, 1) == 14.3
    assert round(counts["wan2.2-ti2v-5b"] / 1e9, 1) == 5.0
    with torch.device("meta"):
        t5 = UMT5EncoderModel(
            UMT5Config(
                vocab_size=256384,
                d_model=4096,
                d_kv=64,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                feed_forward_proj="gated-gelu",
                tie_word_embeddings=False,
            )
        )
        vae = AutoencoderKLWan()
    assert sum(p.numel() for p in t5.parameters()) == FAMILY.text_encoder_params
    assert sum(p.numel() for p in vae.parameters()) == FAMILY.vae_params


def test_conditional_cfg_gradient_leaves_out_the_unconditional_pass(pipe):
    from tests.models.cfg_gradient import assert_unconditional_pass_not_differentiated

    cond = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    latents = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    assert_unconditional_pass_not_differentiated(FAMILY, pipe.transformer, latents, torch.tensor([0.9, 0.4]), cond, 4.0)
