"""What a model family is: everything the recipes need to know about one DiT architecture.

A family (`omni/models/<name>.py`, chosen by `model.family`) loads its diffusers checkpoint
from a local path or builds a tiny random one offline, encodes text into its own
conditioning type, draws and packs initial latents, predicts the flow-matching velocity
(with its own guidance), decodes latents to images and encodes images to latents, and
exports a LoRA in its diffusers pipeline's format; a family that vLLM-Omni's own pipeline
serves (`rollout.options.backend=native`) also states that pipeline's facts
(`ModelFamily.native`, `omni.models.native`). No module of the package outside
`omni/models/` names a family or its classes: the sampler, the worker, checkpoints,
validation, the vLLM-Omni protocol and the native backend all go through this interface and
`omni.models.get_family` (scripts and tests import a family's tiny builder directly).

`ModelFamily` implements what diffusers pipelines share (loading by class name, LoRA
export, the scheduler's noise levels, path and resolution checks); a family fills in the
rest.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


@dataclass
class Conditioning:
    """A family's text conditioning: a dataclass of tensors (or None) with one row per sample.
    Subclasses only declare their fields."""

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def cat(cls, parts: Sequence["Conditioning"]) -> "Conditioning":
        """The conditioning of several batches, one after the other."""
        per_field = ([getattr(p, name) for p in parts] for name in cls.field_names())
        return cls(*(None if tensors[0] is None else torch.cat(tensors) for tensors in per_field))

    def apply(self, fn) -> "Conditioning":
        """A copy with `fn` applied to every tensor present (indexing, moving, ...)."""
        return type(self)(*(None if t is None else fn(t) for t in (getattr(self, n) for n in self.field_names())))

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The fields that are present, by name (for transport)."""
        return {n: getattr(self, n) for n in self.field_names() if getattr(self, n) is not None}

    @classmethod
    def from_tensors(cls, tensors: Dict[str, torch.Tensor]) -> "Conditioning":
        return cls(*(tensors.get(n) for n in cls.field_names()))


def dtype_argument(dtype) -> dict:
    """diffusers' `from_pretrained` keyword for `dtype` (a dtype, or one per component with a
    "default"): `dtype` where the installed diffusers has it, `torch_dtype` (which it then
    deprecates) in the releases before."""
    from diffusers.utils import deprecation_utils

    return {"dtype": dtype} if hasattr(deprecation_utils, "_resolve_dtype") else {"torch_dtype": dtype}


def vae_decode_differentiable(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents in the transformer's scale (unpacked) -> images (B, 3, H, W) in [0, 1], fp32."""
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def vae_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """`vae_decode_differentiable` without gradients."""
    return vae_decode_differentiable(vae, latents)


INVERSION_LR = 0.1  # Adam's step on the latents (transformer scale, about unit variance)


def vae_encode(vae, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
    """Images in [0, 1] -> latents in the transformer's scale (unpacked), fp32 on the CPU:
    the VAE posterior's mode or, with `inversion_steps`, the decoder's inversion."""
    if inversion_steps:
        return invert_decoder(vae, images, device, inversion_steps)
    with torch.no_grad():
        latents = vae.encode((images * 2 - 1).to(device, vae.dtype)).latent_dist.mode().float()
    return ((latents - vae.config.shift_factor) * vae.config.scaling_factor).cpu()


def invert_decoder(vae, images: torch.Tensor, device, steps: int, decode=None, shape=None) -> torch.Tensor:
    """The latents (transformer scale, fp32 on the CPU) whose decoding best matches `images`:
    `steps` Adam steps on the mean squared pixel error, from zero latents (the prior's mean).
    A family whose latents are not the VAE's scaled and shifted ones passes its own
    differentiable `decode` (latents -> images in [0, 1]) and one image's latent `shape`.

    For a VAE whose encoder does not invert its decoder, such as a tiny random one: its
    encoder's latents decode to images unrelated to the input, so training on them (DPO's
    pairs) teaches the model nothing about how the images look. Deterministic for given
    images, like the encoder."""
    target = images.to(device, torch.float32)
    decode = decode or (lambda latents: vae_decode_differentiable(vae, latents))
    shape = shape or (vae.config.latent_channels, *_latent_size(vae, images))
    latents = torch.zeros(len(images), *shape, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([latents], lr=INVERSION_LR)
    frozen = [p for p in vae.decoder.parameters() if p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(False)
    try:
        with torch.enable_grad():
            for _ in range(steps):
                loss = F.mse_loss(decode(latents), target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
    return latents.detach().cpu()


def _latent_size(vae, images: torch.Tensor) -> Tuple[int, int]:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return images.shape[-2] // factor, images.shape[-1] // factor


class ModelFamily:
    """One DiT architecture. Class attributes name its diffusers classes and defaults."""

    name: str = ""
    pipeline_class: str = ""  # the diffusers pipeline, by name (imported when needed)
    transformer_class: str = ""
    conditioning: type = Conditioning
    # Block containers, in the order the layered sync walks them (`model.fsdp.layer_prefixes`).
    layer_prefixes: Tuple[str, ...] = ()
    # Modules a LoRA targets by default, and the pipeline's text encoder attributes.
    lora_targets: Tuple[str, ...] = ()
    text_encoders: Tuple[str, ...] = ()
    # Experts a transformer holds, switched by noise level (`omni.models.wan22`); () for one.
    experts: Tuple[str, ...] = ()
    # Whether it makes videos: `decode` gives clips (B, F, 3, H, W), `rollout.num_frames` counts
    # their frames, and rewards must score clips (validation checks both).
    video: bool = False
    # Whether it edits images: each prompt carries its source image(s) (`omni.data.edits`), which
    # the family encodes into its conditioning beside the instruction, as its pipeline does.
    edit: bool = False
    # The most source images one edit takes (its pipeline's limit, or what it was trained on).
    max_source_images: int = 1
    # Whether the vLLM-Omni engine (rollout=vllm) serves this family; validation refuses it otherwise.
    vllm_served: bool = False
    # vLLM-Omni's own pipeline of the family as `rollout.options.backend=native` extends it (an
    # `omni.models.native.NativePipeline`); None: the native backend does not serve the family.
    native = None
    # For memory estimates: published architectures (name -> transformer config in
    # omni/models/configs/) and the parameters of their text encoders and VAE.
    published_configs: Dict[str, str] = {}
    text_encoder_params: int = 0
    vae_params: int = 0
    # For benchmarks with random weights: the published checkpoints' VAE config (a file in
    # omni/models/configs/).
    published_vae_config: str = ""

    # ----------------------------------------------------------------- checkpoints
    def tiny_path(self, cache_dir: str | os.PathLike, seed: int) -> Path:
        """Directory of the cached tiny random checkpoint for `seed`, built on first use."""
        raise NotImplementedError(f"model family {self.name} has no tiny builder")

    def check_path(self, path: Optional[str], key: str = "model.path") -> Path:
        """Fail early, naming the config key, when a checkpoint directory is unusable."""
        if not path:
            raise ValueError(f"{key} is not set: pass {key}=/path/to/a/diffusers/checkpoint")
        root = Path(path).expanduser()
        if not (root / "model_index.json").is_file():
            raise FileNotFoundError(
                f"{key}={path}: no diffusers checkpoint there (model_index.json missing); "
                f"pass {key}=/path/to/a/local/diffusers/checkpoint directory"
            )
        return root

    def unused_modules(self, transformer_config: dict) -> List[str]:
        """Modules the transformer's output never depends on: a LoRA on them would get no
        gradient, so validation adds them to `model.lora.exclude_modules`."""
        return []

    def check_settings(self, transformer_config: dict, model, rollout) -> None:
        """The family's own rules on the run's `model` and (resolved) `rollout` settings,
        checked before any model loads from the transformer's config alone: a ValueError
        names the key and what the family takes."""

    def apply_settings(self, transformer, model) -> None:
        """Set the run's `model` settings a loaded transformer needs (a family with experts:
        which train, their guidance); called on the actor and on an engine's own copy."""

    def guidance_scales(self, transformer, sigmas, guidance_scale: float):
        """The guidance scale per sample at noise levels `sigmas` (a float: the same for all)."""
        return guidance_scale

    def tiny_resolution_multiple(self) -> int:
        """`resolution_multiple` of the tiny model, known without building it."""
        raise NotImplementedError(f"model family {self.name} has no tiny builder")

    def resolution_multiple(self, path: str | os.PathLike) -> int:
        """Image sizes must be multiples of the VAE's downsampling times the patch size."""
        root = Path(path).expanduser()
        vae = json.loads((root / "vae" / "config.json").read_text())
        patch = json.loads((root / "transformer" / "config.json").read_text())["patch_size"]
        return 2 ** (len(vae["block_out_channels"]) - 1) * patch

    def sequence_length(self, transformer_config: dict, resolution: int, max_sequence_length: int) -> int:
        """Tokens (image and text) a transformer block attends over for one image."""
        raise NotImplementedError(f"model family {self.name} has no memory estimate")

    def published_scheduler_config(self, transformer_config: dict) -> dict:
        """The scheduler config (FlowMatchEulerDiscreteScheduler's arguments) the published
        checkpoint of this transformer config ships, for benchmarks with random weights."""
        raise NotImplementedError(f"model family {self.name} has no published scheduler config")

    def forward_passes(self, guidance_scale: float) -> int:
        """Transformer passes per image and velocity (2 under classifier-free guidance)."""
        return 1

    def pipeline_guidance(self, guidance_scale: float) -> dict:
        """The keyword arguments that give the family's diffusers pipeline `__call__` this
        guidance (for comparisons with the plain pipeline)."""
        return {"guidance_scale": guidance_scale}

    def pipeline_sources(self, prompts, resolution: int) -> dict:
        """The keyword arguments that give the family's diffusers pipeline `__call__` these
        (edit) prompts' source images, as our rollout conditions on them, for an output
        `resolution` pixels square (a pipeline may size its output from more than `height`
        and `width`); {} for text-to-image."""
        return {}

    def source_problem(self, prompt, resolution: int) -> Optional[str]:
        """What makes an (edit) prompt's sources unusable for outputs `resolution` pixels
        square, checked at validation before any model loads; None: nothing."""
        return None

    def sources_problem(self, prompts) -> Optional[str]:
        """What makes a set's sources unusable together (the prompts a batch may mix),
        checked at validation before any model loads; None: nothing."""
        return None

    # ----------------------------------------------------------------- loading
    def _diffusers(self, name: str):
        import diffusers

        return getattr(diffusers, name)

    def transformer_config(self, path: str | os.PathLike) -> dict:
        return self._diffusers(self.transformer_class).load_config(str(path), subfolder="transformer")

    def tiny_transformer_config(self) -> dict:
        raise NotImplementedError(f"model family {self.name} has no tiny builder")

    def meta_transformer(self, path: Optional[str | os.PathLike] = None, config: Optional[dict] = None):
        """The transformer of the checkpoint at `path` (None: the tiny model; or of `config`)
        built on the meta device: its structure and sizes, no weights read or allocated."""
        if config is None:
            config = self.tiny_transformer_config() if path is None else self.transformer_config(path)
        with torch.device("meta"):
            return self._diffusers(self.transformer_class).from_config(config)

    def module_names(self, path: Optional[str | os.PathLike] = None, config: Optional[dict] = None) -> List[str]:
        """Qualified module names of `meta_transformer(path, config)`."""
        return [name for name, _ in self.meta_transformer(path, config).named_modules()]

    def load_transformer(self, path: str | os.PathLike, dtype: torch.dtype, device: Optional[torch.device] = None):
        """The checkpoint's transformer in `dtype`; with `device`, its weights are read straight
        onto it (no whole copy in host memory first, which 8 workers of a node would each hold)."""
        cls = self._diffusers(self.transformer_class)
        placement = {} if device is None else {"device_map": {"": str(device)}}
        return cls.from_pretrained(
            str(path), subfolder="transformer", local_files_only=True, **dtype_argument(dtype), **placement
        )

    def load_pipeline(
        self, path: str | os.PathLike, dtype: torch.dtype, load_base: bool = True, without_transformer: bool = False
    ):
        """The whole pipeline in `dtype`, but its VAE in fp32 (as the reference recipes keep
        it: bf16 decoding shifts the pixels a reward sees); without `load_base` the
        transformer is a random module of the right shape that the first weight sync fills;
        `without_transformer` leaves it out (None) for the caller to set."""
        components = {}
        if without_transformer:
            components["transformer"] = None
        elif not load_base:
            cls = self._diffusers(self.transformer_class)
            components["transformer"] = cls.from_config(self.transformer_config(path)).to(dtype)
        cls = self._diffusers(self.pipeline_class)
        # the VAE is loaded in fp32, not cast after loading (which diffusers warns against)
        return cls.from_pretrained(
            str(path), local_files_only=True, **dtype_argument({"default": dtype, "vae": torch.float32}), **components
        )

    # ----------------------------------------------------------------- sampling
    def encode_prompts(
        self, pipe, prompts: List[str], guidance_scale: float, max_sequence_length: int, device
    ) -> Conditioning:
        raise NotImplementedError

    def complete_conditioning(self, pipe, cond: Conditioning, resolution: int, num_frames: int) -> Conditioning:
        """The prompts' conditioning completed with what depends on the sampling's size (an
        image-to-video family's first-frame condition, whose length is the clip's); most
        families have nothing to add."""
        return cond

    def sigmas(self, pipe, num_steps: int, resolution: int) -> torch.Tensor:
        """The scheduler's noise levels for `num_steps` steps: (num_steps + 1,) on the CPU."""
        pipe.scheduler.set_timesteps(num_steps, device="cpu")
        return pipe.scheduler.sigmas.float().clone()

    def initial_latents(
        self, pipe, generators: Sequence[torch.Generator], resolution: int, num_frames: int = 1
    ) -> torch.Tensor:
        """One initial noise latent per generator, in the transformer's input layout, fp32 CPU;
        `num_frames`: a video family's frames per clip (an image family takes 1)."""
        raise NotImplementedError

    def predict_velocity(
        self, transformer, latents, sigmas, cond: Conditioning, guidance_scale: float, uncond_grad: bool = True
    ) -> torch.Tensor:
        """The flow-matching velocity at noise levels `sigmas` (one per sample), with the
        family's guidance; `latents` and `cond` come in the transformer's dtype and the
        velocity goes back in fp32, so the SDE step and its log-prob stay fp32 around it.
        Under classifier-free guidance (`forward_passes` 2) both passes are differentiated,
        or, `uncond_grad=False`, the conditional one only (`guided_velocity`)."""
        if self.forward_passes(guidance_scale) == 1:
            return self.velocity_pass(transformer, latents, sigmas, cond)
        if not uncond_grad:
            return self.guided_velocity(transformer, latents, sigmas, cond, guidance_scale)[0]
        scale = self.guidance_scales(transformer, sigmas, guidance_scale)
        return self.guide(*self.both_passes(transformer, latents, sigmas, cond), scale)

    def velocity_pass(self, transformer, latents, sigmas, cond: Conditioning, negative: bool = False) -> torch.Tensor:
        """One transformer pass on the prompts' conditioning (or, `negative`, on the
        negative prompt's, classifier-free guidance's unconditional pass), fp32."""
        raise NotImplementedError

    def both_passes(self, transformer, latents, sigmas, cond: Conditioning) -> Tuple[torch.Tensor, torch.Tensor]:
        """(conditional, unconditional) velocities; a family whose passes batch together
        runs them as one."""
        return self.velocity_pass(transformer, latents, sigmas, cond), self.velocity_pass(
            transformer, latents, sigmas, cond, negative=True
        )

    def guide(self, text: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """Classifier-free guidance's combination of the two passes' velocities."""
        return uncond + guidance_scale * (text - uncond)

    def guided_velocity(self, transformer, latents, sigmas, cond: Conditioning, guidance_scale: float, uncond=None):
        """(guided velocity, unconditional velocity) for `algorithm.cfg_gradient=conditional`:
        under gradients, the unconditional pass runs apart without them, or is taken as
        given (`uncond`: the rollout's, while the weights have not changed since); without
        gradients (a rollout keeping it) both passes run as `predict_velocity` runs them."""
        scale = self.guidance_scales(transformer, sigmas, guidance_scale)
        if uncond is None and not torch.is_grad_enabled():
            text, uncond = self.both_passes(transformer, latents, sigmas, cond)
            return self.guide(text, uncond, scale), uncond
        if uncond is None:
            with torch.no_grad():
                uncond = self.velocity_pass(transformer, latents, sigmas, cond, negative=True)
        return self.guide(self.velocity_pass(transformer, latents, sigmas, cond), uncond, scale), uncond

    def decode(self, pipe, latents: torch.Tensor, resolution: int) -> torch.Tensor:
        """Latents -> images (B, 3, H, W), or a video family's clips (B, F, 3, H, W), in [0, 1]."""
        raise NotImplementedError

    def encode_images(self, pipe, images: torch.Tensor, device, inversion_steps: int = 0) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> latents in the transformer's layout, on the CPU
        (the VAE's encoder, or `inversion_steps` of its decoder's inversion: `vae_encode`)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- LoRA export
    def save_lora(self, directory: Path, lora: Dict[str, torch.Tensor], adapter_metadata: dict) -> None:
        """The LoRA as the family's pipeline saves it (`transformer.` keys, PEFT config)."""
        self._diffusers(self.pipeline_class).save_lora_weights(
            directory,
            transformer_lora_layers={k: v.contiguous() for k, v in lora.items()},
            transformer_lora_adapter_metadata=adapter_metadata,
            safe_serialization=True,
        )

    def load_exported_lora(self, pipe, directory: Path, adapter_name: str) -> Dict[str, torch.Tensor]:
        """Load a directory `save_lora` wrote into `pipe` as its diffusers pipeline does
        (`load_lora_weights`); returns the adapter's tensors as loaded, in PEFT names."""
        from peft.utils import get_peft_model_state_dict

        pipe.load_lora_weights(str(directory), adapter_name=adapter_name)
        return get_peft_model_state_dict(pipe.transformer, adapter_name=adapter_name)

    def load_lora(self, directory: Path) -> Dict[str, torch.Tensor]:
        """PEFT-named transformer LoRA tensors of a directory `save_lora` wrote."""
        state = self._diffusers(self.pipeline_class).lora_state_dict(str(directory))
        state = state[0] if isinstance(state, tuple) else state
        prefix = "transformer."
        return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
