"""What is Qwen-Image's own beyond the family contract (tests/models/test_family_contract.py): a
tiny tokenizer that gives the chat template the token count the pipeline drops, our sampler's
ODE images unequal to `QwenImagePipeline.__call__`'s when its true-CFG rescale or its shift is
broken, prompts padded apart that sample as a batch, the per-channel VAE normalisation, and the
unused modules with LoRA on the feed-forwards too."""

import pytest
import torch

import omni.models.qwen_image as qwen
from omni.models import get_family
from omni.models.qwen_image import FAMILY, qwen_tokenizer, tiny_qwen_image_path
from omni.rollout.base import SamplingOptions
from omni.rollout.sampling import sample_rollout

PROMPTS = ["a red cat", "a blue dog with a tree"]


@pytest.fixture(scope="module")
def pipe(tiny_qwen_image_dir):
    pipe = FAMILY.load_pipeline(tiny_qwen_image_dir, torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_family_and_cache(tiny_cache, tiny_qwen_image_dir):
    assert get_family("qwen_image") is FAMILY
    assert tiny_qwen_image_path(tiny_cache, seed=0) == tiny_qwen_image_dir
    assert FAMILY.tiny_resolution_multiple() == FAMILY.resolution_multiple(tiny_qwen_image_dir) == 16


def test_the_template_is_as_many_tokens_as_the_pipeline_drops(pipe):
    """The system part of the chat template is exactly the `prompt_template_encode_start_idx`
    tokens the pipeline drops, so what stays is the prompt and the template's tail; every
    tiny word is one token."""
    tokenizer = qwen_tokenizer()
    head = pipe.prompt_template_encode.split("{}")[0]
    assert len(tokenizer(head).input_ids) == pipe.prompt_template_encode_start_idx
    kept = tokenizer(pipe.prompt_template_encode.format("a red cat")).input_ids[pipe.prompt_template_encode_start_idx :]
    assert tokenizer.convert_ids_to_tokens(kept)[:3] == ["a", "\u0120red", "\u0120cat"]
    assert tokenizer.unk_token_id not in tokenizer("a photo of a yellow bird").input_ids[:-1]


def ode_sample(pipe, guidance_scale, steps=3, prompts=PROMPTS):
    """Our sampler with every step an ODE step."""
    options = SamplingOptions(steps, 64, guidance_scale, noise_level=0.7, max_sequence_length=16, sde_steps=(0, 0))
    return sample_rollout(FAMILY, pipe, prompts, [3, 4], options, 4, torch.device("cpu"), torch.float32)


def pipeline_images(pipe, latents, guidance_scale, steps=3):
    return pipe(
        PROMPTS, height=64, width=64, num_inference_steps=steps, max_sequence_length=16, latents=latents.clone(),
        output_type="pt", **FAMILY.pipeline_guidance(guidance_scale),
    ).images  # fmt: skip


def test_ode_sampling_equals_qwen_image_pipeline(pipe, monkeypatch):
    """True CFG at 4 with the negative prompt " ": the same images as the pipeline, from the
    same initial latents as its own for the same generators; a broken rescale or a shift
    computed for another resolution gives other images."""
    ours = ode_sample(pipe, 4.0)
    theirs = pipeline_images(pipe, ours.latents[:, 0], 4.0)
    assert ours.latents.shape == (2, 4, 16, 64) and theirs.std() > 0.05
    assert (ours.images - theirs).abs().max() < 1e-5
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    assert torch.equal(ours.latents[:, 0], pipe.prepare_latents(2, 16, 64, 64, torch.float32, "cpu", generators))

    monkeypatch.setattr(qwen, "true_cfg", lambda cond, uncond, scale: uncond + scale * (cond - uncond))
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() > 1e-3
    monkeypatch.undo()
    sigmas = FAMILY.sigmas
    monkeypatch.setattr(FAMILY, "sigmas", lambda p, n, resolution: sigmas(p, n, 1024))
    assert (ode_sample(pipe, 4.0).images - theirs).abs().max() > 1e-3


def test_without_guidance_one_pass_runs(pipe):
    """The equality itself is the family contract's; here, no negative pass and other images."""
    ours = ode_sample(pipe, 1.0)
    assert ours.cond.neg_embeds is None
    assert (ours.images - ode_sample(pipe, 4.0).images).abs().max() > 1e-3


def test_prompts_encoded_apart_sample_as_a_batch(pipe):
    """Rows are padded to max_sequence_length with a mask, so prompts encoded one by one stack
    and give the images of the batch encoded at once (cut to its longest prompt)."""
    together = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    apart = FAMILY.conditioning.cat([FAMILY.encode_prompts(pipe, [p], 4.0, 16, "cpu") for p in PROMPTS])
    assert together.embeds.shape == (2, 16, 32) and together.mask.sum(1).tolist() == [8, 11]
    latents, sigmas = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0)), torch.tensor([0.9, 0.5])
    with torch.no_grad():
        a = FAMILY.predict_velocity(pipe.transformer, latents, sigmas, together, 4.0)
        b = FAMILY.predict_velocity(pipe.transformer, latents, sigmas, apart, 4.0)
    assert torch.allclose(a, b, atol=1e-5)


def test_shift_grows_with_the_resolution(pipe):
    small, large = FAMILY.sigmas(pipe, 4, 64), FAMILY.sigmas(pipe, 4, 1024)
    assert small[0] == large[0] == 1 and small[-1] == large[-1] == 0
    assert torch.all(large[1:-2] > small[1:-2] + 0.01)
    # both stretched to end at the scheduler's shift_terminal
    assert abs(float(small[-2]) - 0.02) < 1e-6 and abs(float(large[-2]) - 0.02) < 1e-6


def test_vae_round_trip_uses_the_per_channel_normalisation(pipe):
    """encode_images inverts decode's normalisation: a latent decoded and re-encoded comes
    back near itself only with latents_mean / latents_std applied both ways."""
    images = FAMILY.decode(pipe, ode_sample(pipe, 1.0).latents[:, -1], 64)
    latents = FAMILY.encode_images(pipe, images, "cpu")
    assert latents.shape == (2, 16, 64)
    raw = qwen.pack(pipe.vae.encode((images * 2 - 1)[:, :, None]).latent_dist.mode()[:, :, 0])
    mean, std = (torch.tensor(getattr(pipe.vae.config, k)) for k in ("latents_mean", "latents_std"))
    assert torch.allclose(latents, (raw - mean.repeat_interleave(4)) / std.repeat_interleave(4), atol=1e-5)


def test_unused_modules_are_exactly_the_lora_modules_without_a_gradient(tiny_qwen_image_dir, pipe):
    """With LoRA on every projection and feed-forward of both streams (the preset's targets),
    the modules the family calls unused are those whose LoRA gets no gradient, and no others."""
    from omni.config.model import LoraConfig
    from omni.weights import add_lora_adapter

    targets = [*FAMILY.lora_targets, "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
    actor = FAMILY.load_transformer(tiny_qwen_image_dir, torch.float32)
    add_lora_adapter(actor, LoraConfig(rank=4, target_modules=targets))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a zero LoRA B would hide every A's gradient
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    cond = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    latents = torch.randn(2, 16, 64, generator=generator)
    FAMILY.predict_velocity(actor, latents, torch.tensor([0.9, 0.4]), cond, 4.0).square().sum().backward()
    without_gradient = {
        name.split(".lora_")[0].removeprefix("base_model.model.")
        for name, p in actor.named_parameters()
        if "lora_A" in name and (p.grad is None or p.grad.abs().max() == 0)
    }
    assert without_gradient == set(FAMILY.unused_modules(FAMILY.tiny_transformer_config()))


def test_conditional_cfg_gradient_leaves_out_the_unconditional_pass(pipe):
    from tests.models.cfg_gradient import assert_unconditional_pass_not_differentiated

    cond = FAMILY.encode_prompts(pipe, PROMPTS, 4.0, 16, "cpu")
    latents = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    assert_unconditional_pass_not_differentiated(FAMILY, pipe.transformer, latents, torch.tensor([0.9, 0.5]), cond, 4.0)
