"""What is Z-Image's own beyond the family contract (tests/models/test_family_contract.py): its
guidance form (pos + s (pos - neg), on from any s > 0) that the usual CFG combination would
not reproduce, a tiny tokenizer that renders Qwen3's chat template in known words, prompts
padded apart that sample as a batch, the published architecture's size, and (slow) a short run
of the real CLI whose exported LoRA `ZImagePipeline.load_lora_weights` loads."""

import pytest
import torch

from omni.models import get_family
from omni.models.z_image import FAMILY, tiny_z_image_path
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import PromptCache, sample_rollout

# a tuple: ZImagePipeline rewrites a prompt list in place (its chat template), so each call gets a copy
PROMPTS = ("a red cat", "a blue dog with a tree")


@pytest.fixture(scope="module")
def tiny_dir(tiny_cache):
    return tiny_z_image_path(tiny_cache, seed=0)


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    pipe = FAMILY.load_pipeline(tiny_dir, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ode_sample(pipe, guidance_scale, prompts=PROMPTS):
    options = SamplingOptions(3, 64, guidance_scale, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 0))
    return sample_rollout(FAMILY, pipe, list(prompts), [3, 4], options, 4, torch.device("cpu"), torch.float32)


def test_family_and_cache(tiny_cache, tiny_dir):
    assert get_family("z_image") is FAMILY
    assert tiny_z_image_path(tiny_cache, seed=0) == tiny_dir
    assert FAMILY.resolution_multiple(tiny_dir) == 16


def test_guidance_is_z_images_form_from_any_positive_scale(pipe, monkeypatch):
    """0 is one pass; 0.5 already guides (two passes, other images); the usual CFG
    combination uncond + s (text - uncond) gives other images than the pipeline's."""
    assert FAMILY.forward_passes(0.0) == 1 and FAMILY.forward_passes(0.5) == 2
    unguided, half = ode_sample(pipe, 0.0), ode_sample(pipe, 0.5)
    assert unguided.cond.neg_embeds is None and half.cond.neg_embeds is not None
    assert (unguided.images - half.images).abs().max() > 1e-3
    theirs = pipe(
        list(PROMPTS), height=64, width=64, num_inference_steps=3, max_sequence_length=16, guidance_scale=4.0,
        generator=[torch.Generator().manual_seed(s) for s in (3, 4)], output_type="pt",
    ).images  # fmt: skip
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() < 1e-5
    monkeypatch.setattr(FAMILY, "guide", lambda text, uncond, scale: uncond + scale * (text - uncond))
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() > 1e-3


def test_prompt_cache_encodes_negatives_for_any_guided_scale(pipe):
    """Rows cached without guidance are not reused for a scale in (0, 1], which guides."""
    cache = PromptCache(FAMILY, pipe, "cpu", offload=False)
    assert cache.encode(PROMPTS, 0.0, 16).neg_embeds is None
    assert cache.encode(PROMPTS, 0.5, 16).neg_embeds is not None


def test_chat_template_renders_known_words(pipe):
    """The prompt goes in a user turn and the assistant's header follows (thinking on, as the
    pipeline asks); every word of it is a token of the tiny vocabulary."""
    text = pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a red cat"}], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert text == "<|im_start|>user\na red cat<|im_end|>\n<|im_start|>assistant\n"
    tokens = pipe.tokenizer.convert_ids_to_tokens(pipe.tokenizer(text).input_ids)
    assert pipe.tokenizer.unk_token not in tokens and tokens[:3] == ["<|im_start|>", "user", "\u010a"]


def test_prompts_encoded_apart_sample_as_a_batch(pipe):
    together = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    apart = FAMILY.conditioning.cat([FAMILY.encode_prompts(pipe, [p], 4.0, 16, "cpu") for p in PROMPTS])
    assert together.embeds.shape == (2, 16, 32) and together.mask.sum(1).tolist() == [11, 14]
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        a = FAMILY.predict_velocity(pipe.transformer, latents, sigmas, together, 4.0)
        b = FAMILY.predict_velocity(pipe.transformer, latents, sigmas, apart, 4.0)
    assert torch.allclose(a, b, atol=1e-5)


def test_published_architecture_and_scheduler():
    """Z-Image-Turbo's shipped transformer config is the 6.15B model; its VAE is FLUX.1's
    16-channel one; its scheduler a fixed shift of 3."""
    from omni.memory import arch_config

    config = arch_config(FAMILY, "z-image-turbo")
    count = sum(p.numel() for p in FAMILY.meta_transformer(config=config).parameters())
    assert round(count / 1e9, 2) == 6.15
    assert config["in_channels"] == 16 and FAMILY.published_vae_config == "flux.1-vae.json"
    assert FAMILY.published_scheduler_config(config) == {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": False,
    }
    assert FAMILY.sequence_length(config, 1024, 512) == 64 * 64 + 512


@pytest.mark.slow
def test_train_cli_exports_a_lora_the_pipeline_loads(tmp_path, tiny_cache, tiny_dir):
    """`recipes/train.py model=z_image_tiny` for two Flow-GRPO steps; the checkpoint's LoRA
    loads with ZImagePipeline.load_lora_weights and gives its transformer the velocity of the
    run's LoRA loaded into ours."""
    from tests.models.cli_lora import assert_exported_lora_matches
    from tests.recipes.test_train import train

    train(
        tmp_path / "run", tiny_cache, "model=z_image_tiny", "trainer.steps=2", "trainer.batch_size=8",
        "algorithm.group_size=4", "rollout.num_steps=4", "eval.images_per_prompt=1",
    )  # fmt: skip
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    assert_exported_lora_matches(FAMILY, tiny_dir, tmp_path / "run", PROMPTS, latents)
