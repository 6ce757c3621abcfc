"""`rollout.options.backend=native`: vLLM-Omni's own pipeline of the family, with our SDE step.

The `vllm` backend runs a diffusers pipeline of ours inside vLLM-Omni; this backend runs
vLLM-Omni's own pipeline of the family (the one the family names in its facts,
`ModelFamily.native`, `omni.models.native`: e.g. its `StableDiffusion3Pipeline` for SD3,
with their fused-projection transformers, attention backends, text encoders and VAE), so
rollouts get vLLM-Omni's kernels. Nothing here names a family: our class for a family,
`Native` + vLLM-Omni's class name (`NativeStableDiffusion3Pipeline`), is `NativeRollout` mixed
into that pipeline, made when vLLM-Omni first asks this module for it. `NativeRollout` adds
three hooks to such a pipeline, all through interfaces vLLM-Omni's pipelines already have,
none a copy of their code:

- the scheduler: its denoising loop steps `self.scheduler`; ours (`FlowGRPOScheduler`)
  takes the Flow-GRPO SDE / ODE steps, records the fp32 trajectory and per-step log-probs;
- the transformer's timestep: a forward pre-hook gives it the fp32 timestep of the
  scheduler's step, computed as the family's actor computes it (`native.timestep`;
  SD3 and Wan: 1000 sigma; FLUX: sigma, which its transformer multiplies by 1000 itself;
  Qwen-Image: (1000 sigma) / 1000, as its pipeline hands the scheduler's timestep over).
  vLLM-Omni's loops cast the timestep to the model's dtype first (FLUX's and Qwen-Image's
  also divide the cast 1000 sigma by 1000); in bf16 that rounds t = 1000 sigma by up to 2,
  and the actor, which re-scores with fp32 timesteps, would see another velocity;
- `diffuse` and `forward`, extended (they call vLLM-Omni's): `diffuse` notes the text
  conditioning it is given (the actor re-scores with it; Qwen-Image's padded to
  `max_sequence_length` with its mask, as our family keeps it, since vLLM-Omni pads a
  batch to its longest prompt only), `forward` starts and finishes
  the scheduler's rollout around vLLM-Omni's forward, decodes the fp32 final latent and
  answers with the same `DiffusionOutput` fields as our `vllm` backend
  (`omni.rollout.vllm_protocol.output_fields`; Qwen-Image's image also in the metadata
  group, as its post-process makes PIL images of the payload), so the driver gets the same
  RolloutBatch (Wan's clips as (frames, 3, H, W) images). FLUX's and Qwen-Image's latents
  stay packed, as our families keep them (vLLM-Omni packs them the same way, and our
  scheduler draws its noise unpacked and packs it, as the in-process sampler).

An edit family's requests carry their sources (`multi_modal_data`, opened by
`omni.rollout.vllm_protocol.request_inputs`); vLLM-Omni's pipeline encodes them, and the
reference latents its loop is given join the conditioning (FLUX.1 Kontext's `image_latents`;
Qwen-Image-Edit-Plus's also with their grids, `img_shapes`),
so the actor re-scores with exactly what the engine conditioned on. Where vLLM-Omni's
`forward` takes a setting as an argument rather than from the request (Kontext's text
length), the family's `native.forward_arguments` passes it.

FLUX.1-dev's distilled guidance needs nothing of ours: vLLM-Omni's loop gives the
transformer the same fp32 guidance vector (`guidance_scale` per image) the actor does, and
no negative prompt means no true CFG pass. Wan's CFG is vLLM-Omni's loop too (v_neg +
s (v_pos - v_neg) on the prompt "", as ours); its UniPC solver gives way to the checkpoint's
Euler flow (`WanNative.prepare`). Qwen-Image's true CFG is vLLM-Omni's own loop:
the same combination and per-token norm rescale as our family's, run when the request
carries the negative prompt " " and `true_cfg_scale` (the server adds them:
`omni.rollout.native_support.request_guidance`).

Weights: base weights come as plain state-dict names and load through
`omni.rollout.native_names` (the family's `native.fused` and `native.renamed`) into
vLLM-Omni's parameters with their own weight loaders; LoRA adapters go through vLLM-Omni's
LoRA manager (loaded by path, chosen per request; see `omni.rollout.vllm_worker` and
`omni.rollout.vllm_server`); where vLLM-Omni renames a module (Qwen-Image's `to_out.0`),
the adapter's module names are renamed as it loads.

Imported only in the engine env (it imports vLLM-Omni).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

from omni.models import get_family
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.native_names import check_complete, native_module, native_names
from omni.rollout.native_scheduler import FlowGRPOScheduler
from omni.rollout.native_support import native_class_name, native_facts, native_families
from omni.rollout.transport import LORA_CONFIG_FILE, LORA_FILE, read_weights
from omni.rollout.vllm_protocol import group_by_options, output_fields, prompt_text, request_rows

TRANSFORMER_PREFIX = "transformer."


def native_targets(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """vLLM-Omni's base tensors by name: its parameters (a LoRA wrapper's `.base_layer`
    dropped, LoRA buffers left out) and persistent buffers (SD3's positional table); a
    tensor registered under two names counts once, under the first."""
    state = module.state_dict(keep_vars=True)
    seen, targets = set(), {}
    for name, tensor in state.items():
        if "lora_" in name or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        targets[name.replace(".base_layer", "")] = tensor
    return targets


@torch.no_grad()
def load_native_base(module: torch.nn.Module, family: str, tensors: Dict[str, torch.Tensor]) -> int:
    """Plain-named base weights into vLLM-Omni's transformer; every parameter (every shard
    of a fused one) must be filled exactly once. Returns the number of tensors loaded."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    targets = native_targets(module)
    mapped = native_names(family, tensors)
    check_complete(family, mapped.values(), targets)
    packed = [n for n, t in targets.items() if t.numel() == 0]
    if packed:
        raise RuntimeError(
            f"vLLM-Omni's {family} transformer holds {packed[:3]}... in a packed form a sync cannot write"
        )
    for name, (target, shard) in mapped.items():
        param = targets[target]
        loader = getattr(param, "weight_loader", None)
        tensor = tensors[name].to(param.dtype)
        if shard is not None:
            loader(param, tensor, shard)
        elif loader is not None:
            loader(param, tensor)
        else:
            default_weight_loader(param, tensor)
    return len(mapped)


def keep_linear_weights(module: torch.nn.Module) -> None:
    """On a CPU, vLLM repacks a linear layer's weight for its GEMM kernels after loading and
    empties the parameter, so later syncs would have nowhere to write; a layer marked
    `skip_weight_relayout` keeps its weight and computes with torch's linear."""
    for layer in module.modules():
        if hasattr(layer, "quant_method"):
            layer.skip_weight_relayout = True


def declare_fused_projections(transformer: torch.nn.Module, family: str) -> None:
    """vLLM-Omni's LoRA manager applies a to_q/to_k/to_v adapter to the fused `to_qkv` by the
    transformer's `stacked_params_mapping`; SD3's `load_weights` sets it, FLUX's keeps it
    local, so a transformer without one gets the family's fusion rules (`native.fused`)."""
    if getattr(transformer, "stacked_params_mapping", None) is None:
        facts = native_facts(family)
        rules = [(facts.fused_module(plain), plain) for plain in facts.fused]
        transformer.stacked_params_mapping = [(f".{fused}", f".{plain}", shard) for (fused, shard), plain in rules]


class NativeRollout:
    """Flow-GRPO rollouts from the vLLM-Omni pipeline this is mixed into (before it).
    `custom_pipeline_args`: "family" and "load_base" (False: no checkpoint weights for the
    transformer, whose first sync fills it; the text encoders still load theirs).

    A family's class (`native_pipeline`) names `family_name`; everything else of the family
    comes from its facts (`self.native`: conditioning arguments, noise layout, timestep,
    fused projections, prompt encoding)."""

    family_name: str = ""

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        args = od_config.custom_pipeline_args or {}
        self.family = get_family(self.family_name)
        self.native = native_facts(self.family_name)
        self.has_base = bool(args.get("load_base", True))
        if not self.has_base:  # vLLM-Omni's loader reads no transformer weights
            self.weights_sources = [s for s in self.weights_sources if s.prefix != TRANSFORMER_PREFIX]
        self.transformer.load_weights(())  # SD3's declares its fused projections here
        declare_fused_projections(self.transformer, self.family_name)
        # vLLM-Omni's pipelines name their device `device`, its FluxKontextPipeline `_execution_device`
        if (getattr(self, "device", None) or self._execution_device).type == "cpu":
            keep_linear_weights(self.transformer)
        self.native.prepare(self)
        self.scheduler = FlowGRPOScheduler.from_config(self.scheduler.config)
        self.transformer.register_forward_pre_hook(self._fp32_timesteps, with_kwargs=True)
        self._given: Dict[str, Any] = {}

    # ----------------------------------------------------------------- loading
    def load_weights(self, weights: Iterable) -> Optional[set]:
        if self.has_base:
            return super().load_weights(weights)
        if not self.weights_sources:
            for name, _ in weights:
                raise ValueError(f"started without base weights (load_base false), yet the loader sent {name}")
            return None  # nothing loaded on purpose: skips the loader's completeness check
        return super().load_weights(_refuse_transformer(weights))

    def sync_weights_from(self, path: str) -> Dict[str, Any]:
        """Base weights from a directory of `omni.rollout.transport` (LoRA adapters take
        vLLM-Omni's LoRA manager instead: the worker extension's `omni_add_lora`)."""
        kind, tensors, _ = read_weights(path)
        if kind != "base":
            raise ValueError(
                f"{path}: a {kind} sync; the native backend loads LoRA adapters with vLLM-Omni's LoRA manager"
            )
        count = load_native_base(self.transformer, self.family_name, tensors)
        self.has_base = True
        return {"kind": kind, "tensors": count, "has_base": True}

    # ----------------------------------------------------------------- hooks
    def _fp32_timesteps(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        sigmas = self.scheduler.rollout_sigmas(hidden.shape[0], hidden.device) if hidden is not None else None
        if sigmas is None or "timestep" not in kwargs:
            return None
        return args, {**kwargs, "timestep": self.native.timestep(sigmas)}

    def diffuse(self, *args, **kwargs):
        given = inspect.signature(super().diffuse).bind(*args, **kwargs).arguments
        self._given = {name: given.get(name) for name in self.native.cond_arguments}
        return super().diffuse(*args, **kwargs)

    # ----------------------------------------------------------------- sampling
    def forward(self, req: DiffusionRequestBatch) -> List[DiffusionOutput]:
        """One `DiffusionOutput` per request (its outputs, `num_outputs_per_prompt` of them,
        each drawn from its own seed), in order; requests with different sampling options
        take separate passes of vLLM-Omni's forward."""
        texts = [prompt_text(p) for p in req.prompts]
        params = req.sampling_params_list
        outputs: List[Optional[DiffusionOutput]] = [None] * len(texts)
        for options, requests in group_by_options(texts, params):
            part = (
                req
                if len(requests) == len(texts)
                else DiffusionRequestBatch(requests=[req.requests[i] for i in requests])
            )
            prompts, seeds, spans = request_rows(texts, params, requests)
            batch = self._rollout(part, prompts, seeds, options)
            for i, (start, stop) in zip(requests, spans):
                outputs[i] = DiffusionOutput(**output_fields(batch, range(start, stop), self.native.post_process))
        return outputs

    @torch.no_grad()
    def _rollout(self, req, prompts: List[str], seeds: List[int], options: SamplingOptions) -> RolloutBatch:
        self.scheduler.start_rollout(seeds, options, self.native.noise)
        try:
            super().forward(req, **self.native.forward_arguments(options))
            final = self.scheduler.final_latents()
            trajectory = self.scheduler.finish_rollout()
        finally:
            self.scheduler.cancel_rollout()
        images = self.family.decode(self, final, options.resolution).cpu()
        cond = self.native.conditioning(self.family, self._given, options.max_sequence_length).apply(lambda t: t.cpu())
        return RolloutBatch(prompts, images, trajectory.latents, trajectory.log_probs, trajectory.sigmas, cond, options)

    # ----------------------------------------------------------------- LoRA
    def _load_diffusion_lora_adapter(self, lora_request, lora_path: str, dtype):
        """vLLM-Omni's LoRA manager asks its pipeline first (None: its own loader). A family
        whose modules vLLM-Omni renames (its `native.renamed`) gets the adapter's module
        names and target modules renamed, else its adapters on renamed modules would load
        nowhere."""
        if not native_facts(self.family_name).renamed:
            return None
        from safetensors.torch import load_file
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        config = json.loads((Path(lora_path) / LORA_CONFIG_FILE).read_text())
        config["target_modules"] = [native_module(self.family_name, m) for m in config["target_modules"]]
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": None})
        tensors = {
            native_module(self.family_name, k): v for k, v in load_file(str(Path(lora_path) / LORA_FILE)).items()
        }
        return LoRAModel.from_lora_tensors(lora_request.lora_int_id, tensors, helper, device="cpu", dtype=dtype), helper

    # ----------------------------------------------------------------- encoding
    def encode_prompts(self, prompts, guidance_scale: float, max_sequence_length: int):
        """The family's conditioning from vLLM-Omni's text encoders (`native.encode_prompts`)."""
        return self.native.encode_prompts(self, prompts, guidance_scale, max_sequence_length)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        inversion_steps = (self.od_config.custom_pipeline_args or {}).get("vae_inversion_steps", 0)
        return self.family.encode_images(self, images, self.vae.device, inversion_steps)


@functools.lru_cache(maxsize=None)
def native_pipeline(family: str) -> type:
    """`NativeRollout` mixed into vLLM-Omni's pipeline of `family` (its `native.pipeline`),
    named `native_class_name(family)` in this module, so vLLM-Omni and pickle find it by name."""
    module, _, name = native_facts(family).pipeline.rpartition(".")
    base = getattr(importlib.import_module(module), name)
    qualname = native_class_name(family)
    doc = f"vLLM-Omni's {name} sampling Flow-GRPO rollouts."
    namespace = {"family_name": family, "__module__": __name__, "__qualname__": qualname, "__doc__": doc}
    return type(qualname, (NativeRollout, base), namespace)


def __getattr__(name: str) -> type:
    """Our pipeline class of a family, by its name (vLLM-Omni imports it by qualified name:
    `omni.rollout.native_support.native_pipeline_class`)."""
    for family in native_families():
        if native_class_name(family) == name:
            return native_pipeline(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _refuse_transformer(weights: Iterable) -> Iterable:
    """The loader's weights (text encoders), failing on a transformer weight: without a base,
    the first sync must fill the transformer, not the checkpoint."""
    for name, tensor in weights:
        if name.startswith(TRANSFORMER_PREFIX):
            raise ValueError(f"started without base weights (load_base false), yet the loader sent {name}")
        yield name, tensor
