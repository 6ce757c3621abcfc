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


def _pair(qk_norm):
    """The tiny MMDiT twice, same weights: diffusers' attention everywhere, and the family's
    settings applied (the last block with `ImageQueryAttention`)."""
    from omni.models.sd3 import ImageQueryAttention, build_tiny_transformer

    reference = build_tiny_transformer(seed=1, qk_norm=qk_norm)
    ours = build_tiny_transformer(seed=1, qk_norm=qk_norm)
    FAMILY.apply_settings(ours, None)
    assert isinstance(ours.transformer_blocks[-1].attn.processor, ImageQueryAttention)
    return reference, ours


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(3, 4, 8, 8, generator=g),
        timestep=torch.tensor([900.0, 400.0, 20.0]),
        encoder_hidden_states=torch.randn(3, 21, 64, generator=g),
        pooled_projections=torch.randn(3, 64, generator=g),
        return_dict=False,
    )


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_last_block_attends_with_image_queries_only_to_the_same_bits(qk_norm):
    """The last block's text outputs are dropped, so computing only the image tokens'
    queries gives diffusers' output bit for bit (SD3.5's q/k norms too); the LoRA
    gradients of a LoRA on every projection but the unused one are the same bits too."""
    from omni.config.model import LoraConfig
    from omni.weights import add_lora_adapter, lora_tensors

    reference, ours = _pair(qk_norm)
    with torch.no_grad():
        assert torch.equal(reference(**_inputs())[0], ours(**_inputs())[0])
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    lora = LoraConfig(
        rank=4, alpha=4, target_modules=targets, exclude_modules=FAMILY.unused_modules(FAMILY.tiny_transformer_config())
    )
    for model in (reference, ours):
        model.requires_grad_(False)
        add_lora_adapter(model, lora)
    weights = lora_tensors(reference, lora.adapter_name)
    for name, p in weights.items():
        if "lora_B" in name:  # B = 0 would leave every lora_A without a gradient
            p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
    for name, p in lora_tensors(ours, lora.adapter_name).items():
        p.data = weights[name].detach().clone()
    grads = []
    for model in (reference, ours):
        model(**_inputs())[0].square().sum().backward()
        grads.append({n: p.grad for n, p in lora_tensors(model, lora.adapter_name).items()})
    assert grads[0].keys() == grads[1].keys()
    assert not any("transformer_blocks.1.attn.add_q_proj" in n for n in grads[0])
    for name in grads[0]:
        assert grads[1][name] is not None and torch.equal(grads[0][name], grads[1][name]), name


def test_last_block_keeps_diffusers_attention_while_its_text_queries_train():
    """Full fine-tuning: the text query projection of the last block gets the zero gradient
    it gets under diffusers' attention (not None, which optimizers and the replicated
    all-reduce treat otherwise), and every gradient is the same."""
    reference, ours = _pair(None)
    for model in (reference, ours):
        model(**_inputs())[0].square().sum().backward()
    unused = ours.transformer_blocks[-1].attn.add_q_proj.weight.grad
    assert unused is not None and not unused.any()
    for (name, a), (_, b) in zip(reference.named_parameters(), ours.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name
