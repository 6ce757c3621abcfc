"""Wan2.2 A14B (T2V) as a model family: two experts, one transformer each, switched by noise level.

`WanPipeline` with `transformer_2` and `boundary_ratio` (diffusers) runs its `transformer` (the
high-noise expert) at every timestep t >= boundary_ratio x num_train_timesteps and its
`transformer_2` (the low-noise expert) below, each under its own guidance scale
(`guidance_scale` and `guidance_scale_2`, the latter defaulting to the former). Everything
else (text, latents, VAE, decoding) is Wan's (`omni.models.wan`).

Here both experts live in one module, `WanExperts` (`high_noise.` and `low_noise.`), that
routes each sample of a batch to its expert by its own timestep; the sampler, the SDE
log-probs, the update, the weight sync and FSDP see it as one transformer, so every step of a
rollout and of an update is scored by the expert the pipeline runs at that step. A LoRA goes
on the experts `model.train_experts` names (default both); an expert left out runs frozen.
`model.guidance_scale_2` is the low-noise expert's guidance (null: `rollout.guidance_scale`).

Memory: both experts are resident on every worker (2 x 14.3B parameters for A14B, 57 GB in
bf16 before sharding), although one runs per step; the activations are one expert's
(`python scripts/estimate_memory.py model=wan22` shows them per expert). With several workers
the experts run unsharded (`model.fsdp.version=0`): FSDP's collectives would wait on an
expert another rank's samples did not route to.

LoRA export (`save_lora`): the high-noise expert's LoRA as `pytorch_lora_weights.safetensors`
and the low-noise expert's as `pytorch_lora_weights_transformer_2.safetensors`, both under
`transformer.` names as `WanPipeline.save_lora_weights` writes them; diffusers loads the
second with `pipe.load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)`.

The tiny checkpoint is the tiny Wan with a second, differently seeded transformer and the
published boundary_ratio 0.875; with its shift of 3, a 3-step sampling runs the high-noise
expert at its first step and the low-noise one after.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Dict, Optional

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from omni.models.base import dtype_argument
from omni.models.tiny_parts import cached_checkpoint, save_pipeline, t5_tokenizer
from omni.models.wan import (
    TINY_SHIFT,
    TINY_TEXT_LENGTH,
    TINY_TRANSFORMER,
    WanFamily,
    WanNative,
    umt5_encoder,
    wan_vae,
)

TINY_BUILDER_VERSION = 1
# Wan2.2-T2V-A14B's model_index.json (and the Wan2.2 repository's t2v_A14B config: boundary 0.875).
TINY_BOUNDARY_RATIO = 0.875
EXPERTS = ("high_noise", "low_noise")  # the pipeline's transformer, transformer_2
HIGH_NOISE_LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' default weight name
LOW_NOISE_LORA_FILE = "pytorch_lora_weights_transformer_2.safetensors"
LORA_FILES = dict(zip(EXPERTS, (HIGH_NOISE_LORA_FILE, LOW_NOISE_LORA_FILE)))


class WanExperts(ModelMixin, ConfigMixin):
    """The high-noise and low-noise experts as one transformer: a sample whose timestep is at
    least `boundary_timestep` goes to `high_noise`, the others to `low_noise`."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, boundary_timestep: float = 875.0, in_channels: int = 16, patch_size=(1, 2, 2)):
        super().__init__()
        self.trained_experts = EXPERTS
        self.guidance_scale_2: Optional[float] = None

    @classmethod
    def of(cls, high_noise, low_noise, boundary_timestep: float) -> "WanExperts":
        config = high_noise.config
        experts = cls(float(boundary_timestep), config.in_channels, tuple(config.patch_size))
        experts.high_noise, experts.low_noise = high_noise, low_noise
        return experts

    def routes_high(self, timestep: torch.Tensor) -> torch.Tensor:
        return timestep >= self.config.boundary_timestep

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict: bool = False, **kwargs):
        high = self.routes_high(timestep)

        def run(expert, rows):
            return expert(
                hidden_states=hidden_states[rows], timestep=timestep[rows],
                encoder_hidden_states=encoder_hidden_states[rows], return_dict=False, **kwargs,
            )[0]  # fmt: skip

        if bool(high.all()):
            return (run(self.high_noise, slice(None)),)
        if not bool(high.any()):
            return (run(self.low_noise, slice(None)),)
        upper, lower = run(self.high_noise, high), run(self.low_noise, ~high)
        out = upper.new_empty((len(high), *upper.shape[1:]))
        out[high], out[~high] = upper, lower
        return (out,)

    def cache_context(self, name: str, **kwargs):
        """WanPipeline enters its model's cache context; the experts keep no cache here."""
        return contextlib.nullcontext()

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """A LoRA on the trained experts only: the others run frozen, with no adapter."""
        for name in self.trained_experts:
            getattr(self, name).add_adapter(adapter_config, adapter_name=adapter_name)

    def set_adapter(self, adapter_name) -> None:
        for name in self.trained_experts:
            getattr(self, name).set_adapter(adapter_name)


# ----------------------------------------------------------------- tiny checkpoint
def build_tiny_wan22_pipeline(seed: int = 0):
    """A complete random two-expert Wan pipeline, identical for identical seeds."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = t5_tokenizer(TINY_TEXT_LENGTH)
    torch.manual_seed(seed)
    high = WanTransformer3DModel(**TINY_TRANSFORMER)
    torch.manual_seed(seed + 3)
    low = WanTransformer3DModel(**TINY_TRANSFORMER)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=umt5_encoder(tokenizer, seed + 2),
        vae=wan_vae(seed + 1),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=TINY_SHIFT),
        transformer=high,
        transformer_2=low,
        boundary_ratio=TINY_BOUNDARY_RATIO,
    )


def tiny_wan22_path(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Directory of the cached tiny two-expert pipeline for `seed`, built on first use."""
    return cached_checkpoint(
        cache_dir,
        "wan22-tiny",
        TINY_BUILDER_VERSION,
        seed,
        lambda path: save_pipeline(build_tiny_wan22_pipeline(seed), path),
    )


def boundary_timestep(path: str | os.PathLike) -> float:
    """boundary_ratio x the scheduler's num_train_timesteps, as WanPipeline computes it."""
    root = Path(path).expanduser()
    ratio = json.loads((root / "model_index.json").read_text())["boundary_ratio"]
    scheduler = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    return ratio * scheduler.get("num_train_timesteps", 1000)


class Wan22Native(WanNative):
    """vLLM-Omni's Wan pipeline runs both experts too (`transformer_2` below its boundary),
    but the native backend does not extend it for them yet: each expert's weight syncs and
    LoRA adapters would need their own names."""

    extended = False


class Wan22Family(WanFamily):
    name = "wan22"
    experts = EXPERTS
    native = Wan22Native()
    layer_prefixes = ("high_noise.blocks.", "low_noise.blocks.")
    # Each expert is Wan2.1 T2V 14B's architecture (the Wan2.2 repository's wan/configs/
    # wan_t2v_A14B.py: dim 5120, ffn 13824, 40 heads, 40 layers); the estimate holds two.
    published_configs = {"wan2.2-t2v-a14b": "wan2.2-t2v-a14b-transformer.json"}

    def tiny_path(self, cache_dir, seed: int) -> Path:
        return tiny_wan22_path(cache_dir, seed)

    def check_path(self, path: Optional[str], key: str = "model.path") -> Path:
        """A diffusers Wan2.2 checkpoint with both experts and its boundary."""
        root = super(WanFamily, self).check_path(path, key)
        index = json.loads((root / "model_index.json").read_text())
        if (index.get("transformer_2") or [None])[0] is None or index.get("boundary_ratio") is None:
            raise ValueError(
                f"{key}={path}: not a Wan2.2 two-expert checkpoint (model_index.json lacks transformer_2 or "
                "boundary_ratio); for a single-transformer Wan use model=wan"
            )
        return root

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        super().check_settings(transformer_config, model, rollout)
        if model.guidance_scale_2 is not None and rollout.guidance_scale <= 1:
            raise ValueError(
                f"model.guidance_scale_2={model.guidance_scale_2}: the low-noise expert's guidance needs "
                f"classifier-free guidance on (rollout.guidance_scale={rollout.guidance_scale} > 1)"
            )
        if model.fsdp.version in (1, 2):
            raise ValueError(
                f"model.fsdp.version={model.fsdp.version}: Wan2.2's experts are not sharded (a rank would wait "
                "on an expert its samples do not run); set model.fsdp.version=0"
            )

    def apply_settings(self, transformer, model) -> None:
        """The experts that train (`model.train_experts`) and the low-noise guidance."""
        transformer.trained_experts = tuple(e for e in EXPERTS if e in model.train_experts)
        transformer.guidance_scale_2 = model.guidance_scale_2

    def guidance_scales(self, transformer, sigmas, guidance_scale: float):
        """Per sample: `guidance_scale` for the high-noise expert, `guidance_scale_2` below."""
        low = getattr(transformer, "guidance_scale_2", None)
        if low is None:
            return guidance_scale
        high = transformer.routes_high(sigmas.float() * 1000)
        scales = torch.where(high, torch.tensor(float(guidance_scale)), torch.tensor(float(low)))
        return scales.to(sigmas.device).view(-1, *([1] * 4))

    # ----------------------------------------------------------------- loading
    def meta_transformer(self, path=None, config: Optional[dict] = None):
        if config is None:
            config = self.tiny_transformer_config() if path is None else self.transformer_config(path)
        with torch.device("meta"):
            cls = self._diffusers(self.transformer_class)
            return WanExperts.of(cls.from_config(config), cls.from_config(config), 1000 * TINY_BOUNDARY_RATIO)

    def load_transformer(self, path, dtype: torch.dtype, device: Optional[torch.device] = None):
        cls = self._diffusers(self.transformer_class)
        placement = {} if device is None else {"device_map": {"": str(device)}}
        high, low = (
            cls.from_pretrained(str(path), subfolder=sub, local_files_only=True, **dtype_argument(dtype), **placement)
            for sub in ("transformer", "transformer_2")
        )
        return WanExperts.of(high, low, boundary_timestep(path))

    def load_pipeline(self, path, dtype: torch.dtype, load_base: bool = True, without_transformer: bool = False):
        """The pipeline with both experts as `pipe.transformer` (a `WanExperts`) and the
        low-noise one also as `pipe.transformer_2` (the same module), so the pipeline's own
        `__call__` runs as published; see `WanFamily.load_pipeline` for the rest."""
        from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

        pipe = WanPipeline.from_pretrained(
            str(path), local_files_only=True, transformer=None, transformer_2=None,
            **dtype_argument({"default": dtype, "vae": torch.float32}),
        )  # fmt: skip
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=float(pipe.scheduler.config.get("flow_shift", 1.0)))
        if without_transformer:
            return pipe
        if load_base:
            experts = self.load_transformer(path, dtype)
        else:
            cls, config = self._diffusers(self.transformer_class), self.transformer_config(path)
            experts = WanExperts.of(
                cls.from_config(config).to(dtype), cls.from_config(config).to(dtype), boundary_timestep(path)
            )
        pipe.transformer, pipe.transformer_2 = experts, experts.low_noise
        return pipe

    # ----------------------------------------------------------------- LoRA export
    def save_lora(self, directory: Path, lora: Dict[str, torch.Tensor], adapter_metadata: dict) -> None:
        """One file per trained expert (the module docstring names them)."""
        from diffusers import WanPipeline

        for expert, weight_name in LORA_FILES.items():
            prefix = f"{expert}."
            tensors = {k[len(prefix) :]: v.contiguous() for k, v in lora.items() if k.startswith(prefix)}
            if tensors:
                WanPipeline.save_lora_weights(
                    directory, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=adapter_metadata,
                    weight_name=weight_name, safe_serialization=True,
                )  # fmt: skip

    def load_lora(self, directory: Path) -> Dict[str, torch.Tensor]:
        """Both experts' LoRA tensors (PEFT names under `high_noise.` / `low_noise.`)."""
        from diffusers import WanPipeline

        found = {}
        for expert, weight_name in LORA_FILES.items():
            if (Path(directory) / weight_name).is_file():
                state = WanPipeline.lora_state_dict(str(directory), weight_name=weight_name)
                state = state[0] if isinstance(state, tuple) else state
                found.update({f"{expert}.{k.removeprefix('transformer.')}": v for k, v in state.items()})
        return found

    def load_exported_lora(self, pipe, directory: Path, adapter_name: str) -> Dict[str, torch.Tensor]:
        """`WanPipeline.load_lora_weights` on a plain two-expert pipeline's view of `pipe`'s
        experts: the first file into `transformer`, the second with `load_into_transformer_2`."""
        from diffusers import WanPipeline
        from peft.utils import get_peft_model_state_dict

        experts = pipe.transformer
        plain = WanPipeline(
            pipe.tokenizer, pipe.text_encoder, pipe.vae, pipe.scheduler, experts.high_noise, experts.low_noise,
            boundary_ratio=experts.config.boundary_timestep / 1000,
        )  # fmt: skip
        load_both_experts(plain, Path(directory), adapter_name)
        loaded = {}
        for expert, module in zip(EXPERTS, (plain.transformer, plain.transformer_2)):
            if adapter_name in getattr(module, "peft_config", {}):
                state = get_peft_model_state_dict(module, adapter_name=adapter_name)
                loaded.update({f"{expert}.{k}": v for k, v in state.items()})
        return loaded


def load_both_experts(pipe, directory: Path, adapter_name: str) -> None:
    """Load an exported two-expert LoRA into a plain two-expert `WanPipeline` as diffusers
    documents it: the second expert's file with `load_into_transformer_2=True`."""
    if (directory / HIGH_NOISE_LORA_FILE).is_file():
        pipe.load_lora_weights(str(directory), adapter_name=adapter_name)
    if (directory / LOW_NOISE_LORA_FILE).is_file():
        pipe.load_lora_weights(
            str(directory), weight_name=LOW_NOISE_LORA_FILE, adapter_name=adapter_name, load_into_transformer_2=True
        )


FAMILY = Wan22Family()
