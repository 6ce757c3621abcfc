"""Tiny transformers of each family with LoRA adapters, wrapped plain, in FSDP1 or in FSDP2,
and the checks the distributed cells (tests/fsdp_cells.py) make on what is collected from them.

Every builder is seeded, so each rank and the unwrapped reference build the same model; every
check returns a list of problems (empty when it holds) rather than raising, so one cell's
failure is reported beside the others'.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]  # proj_out: a root-level Linear


def lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: random lora_B too, so LoRA values change the outputs
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)


def build_sd3(seed=0):
    from omni.models.sd3 import build_tiny_transformer

    return build_tiny_transformer(seed=seed)


def build_flux(seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    )  # fmt: skip


def build_qwen_image(seed=0):
    from diffusers import QwenImageTransformer2DModel

    from omni.models.qwen_image import TINY_TRANSFORMER

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**TINY_TRANSFORMER)


def build_wan(seed=0):
    from diffusers import WanTransformer3DModel

    from omni.models.wan import TINY_TRANSFORMER

    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY_TRANSFORMER)


BUILDERS = {"sd3": build_sd3, "flux": build_flux, "qwen_image": build_qwen_image, "wan": build_wan}


def with_adapters(kind, adapters, lora_seed=1, base_seed=0):
    model = BUILDERS[kind](base_seed)
    torch.manual_seed(lora_seed)
    for name in adapters:
        model.add_adapter(lora_config(), adapter_name=name)
    return model


def inputs(model):
    g = torch.Generator().manual_seed(7)
    if any("single_transformer_blocks" in n for n, _ in model.named_modules()):  # FLUX, maybe wrapped
        return dict(
            hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
            pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
            img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3), return_dict=False,
        )  # fmt: skip
    if any(n.endswith("img_mlp") for n, _ in model.named_modules()):  # Qwen-Image: a 4x4 grid of packed tokens
        from omni.models.qwen_image import TINY_TRANSFORMER

        text = torch.randn(1, 5, TINY_TRANSFORMER["joint_attention_dim"], generator=g)
        return dict(
            hidden_states=torch.randn(1, 16, 64, generator=g), encoder_hidden_states=text,
            encoder_hidden_states_mask=torch.ones(1, 5), timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )  # fmt: skip
    if any(n.endswith("patch_embedding") for n, _ in model.named_modules()):  # Wan: a 2-frame 4x4 video latent
        from omni.models.wan import TINY_TRANSFORMER

        return dict(
            hidden_states=torch.randn(1, 16, 2, 4, 4, generator=g),
            encoder_hidden_states=torch.randn(1, 5, TINY_TRANSFORMER["text_dim"], generator=g),
            timestep=torch.tensor([500.0]), return_dict=False,
        )  # fmt: skip
    return dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(1, 6, 64, generator=g),
        pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([3.0]), return_dict=False,
    )  # fmt: skip


def output(model):
    with torch.no_grad():
        return model(**inputs(model))[0]


def backward(model):
    model(**inputs(model))[0].pow(2).mean().backward()


def train_step(model):
    """One AdamW step on the same batch on every rank."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    backward(model)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _block_classes(model):
    return {type(m) for n, m in model.named_modules() if n.split(".")[-1].isdigit() and "blocks" in n.split(".")[-2]}


def _trainable_leaf(m: nn.Module) -> bool:
    return not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))


def wrap(model, wrapping):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    blocks = tuple(_block_classes(model))
    cpu = torch.device("cpu")
    if wrapping == "plain":
        return model
    if wrapping == "fsdp1_blocks":  # blocks mix frozen base and trainable LoRA: needs orig params
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(set(blocks)), use_orig_params=True, device_id=cpu)
    if wrapping in ("fsdp1_lora_orig", "fsdp1_lora_flat"):
        policy = CustomPolicy(lambda m: isinstance(m, blocks) or _trainable_leaf(m))
        orig = wrapping == "fsdp1_lora_orig"
        return FSDP(model, auto_wrap_policy=policy, use_orig_params=orig, device_id=cpu)
    return fully_shard(model)


def fully_shard(model, mesh_shape=None, offload=False, reshard_after_forward=None, bf16=False):
    """FSDP2 over the blocks, then the root; a 2-D `mesh_shape` is HSDP (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh_shape = mesh_shape or (torch.distributed.get_world_size(),)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    options = {"mesh": init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)}
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    blocks = tuple(_block_classes(model))
    for m in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(m, **options)
    return fully_shard(model, **options)


# ---------------------------------------------------------------------------------------
# Checks (run inside the workers; each returns a list of problems)
# ---------------------------------------------------------------------------------------


def _storage_ptrs(model) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors}


def _tensor_problems(key, t, model_ptrs) -> list[str]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return [f"{key}: DTensor"]
    problems = []
    if t.device.type != "cpu":
        problems.append(f"{key}: on {t.device}")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        problems.append(f"{key}: does not own its storage ({t.untyped_storage().nbytes()} bytes for {tuple(t.shape)})")
    if t.untyped_storage().data_ptr() in model_ptrs:
        problems.append(f"{key}: aliases a model tensor")
    return problems


def compare(got: dict, expected: dict, model) -> list[str]:
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    problems = [f"missing keys {missing[:5]} ({len(missing)})"] if missing else []
    problems += [f"unexpected keys {extra[:5]} ({len(extra)})"] if extra else []
    ptrs = _storage_ptrs(model)
    for key in sorted(got.keys() & expected.keys()):
        problems += _tensor_problems(key, got[key], ptrs)
        try:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            problems.append(f"{key}: value differs: {str(e).splitlines()[-1]}")
    return problems


def output_problem(what, got, expected) -> list[str]:
    try:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        return []
    except AssertionError as e:
        return [f"{what}: outputs differ: {str(e).splitlines()[-1]}"]


def base_roundtrip(kind, got) -> list[str]:
    fresh = BUILDERS[kind](seed=123)
    try:
        fresh.load_state_dict(got, strict=True)
    except RuntimeError as e:
        return [f"base load_state_dict(strict=True): {str(e)[:300]}"]
    return output_problem("base round trip", output(fresh), output(BUILDERS[kind](seed=0)))


def lora_roundtrip(kind, got, ref, asked) -> list[str]:
    from peft import set_peft_model_state_dict

    fresh = with_adapters(kind, (asked,), lora_seed=999)
    result = set_peft_model_state_dict(fresh, got, adapter_name=asked)
    if result.unexpected_keys:
        return [f"LoRA round trip: unexpected keys {result.unexpected_keys[:5]}"]
    ref.set_adapter(asked)
    return output_problem("LoRA round trip", output(fresh), output(ref))


def digests(state: dict) -> dict[str, str]:
    as_bytes = {k: t.reshape(-1).contiguous().view(torch.uint8).numpy() for k, t in state.items()}  # numpy: no bf16
    return {k: hashlib.sha1(b.tobytes()).hexdigest() for k, b in as_bytes.items()}


def record(fn) -> dict:
    """Run one cell; a raised exception becomes the cell's `error`."""
    try:
        problems, digests = fn()
    except Exception as e:  # noqa: BLE001 - reported per cell, asserted by the parent
        return {"error": f"{type(e).__name__}: {e}", "problems": [], "digests": {}}
    return {"error": None, "problems": problems, "digests": digests}
