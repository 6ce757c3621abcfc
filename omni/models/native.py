"""What a model family tells `rollout.options.backend=native`: vLLM-Omni's own pipeline of
the family, extended with our scheduler (`omni.rollout.vllm_native`).

A family that the native backend serves sets `ModelFamily.native` to an instance of a
`NativePipeline` subclass written in its own module; nothing under `omni/rollout/` names a
family. Its facts:

- `pipeline`: vLLM-Omni's pipeline class of the family, by qualified name, and `hooks`, the
  attributes of it the native backend uses (checked in the engine env before any model loads);
- `fused`, `renamed` and `renamed_parameters`: where vLLM-Omni's transformer fuses projections
  into one parallel linear layer (to_q/to_k/to_v -> the shards q/k/v of to_qkv, add_q/k/v_proj
  -> add_kv_proj; a rule keyed by a path tail, Wan's `attn1.to_q`, fuses that attention's
  only), renames module path parts (Qwen-Image's `to_out.0` -> `to_out`) and moves a root
  parameter into a module (Wan's `scale_shift_table`), so base weights and LoRA adapters in
  diffusers' names reach vLLM-Omni's parameters (`omni.rollout.native_names`);
- `timestep`: the transformer's timestep for the scheduler's fp32 noise levels, computed as the
  family's actor computes it (vLLM-Omni's loop would hand over a timestep cast to the model's
  dtype, which in bf16 rounds t = 1000 sigma by up to 2);
- `cond_arguments` and `conditioning`: the arguments of the pipeline's `diffuse` that make the
  family's conditioning, in its fields' order, and the conditioning made of them; and
  `encode_prompts`, the family's conditioning from vLLM-Omni's own text encoders;
- `noise`: the step noise's layout (a packed family draws it unpacked and packs it, as its
  initial latent), so the scheduler draws what the in-process sampler draws;
- `post_process`: what vLLM-Omni's post-process of the family does with the output even
  with output_type latent (`omni.rollout.vllm_protocol`: passes it, converts the payload's
  image, or takes an image tensor only), which decides how the answer is laid out;
- `groups_outputs`: whether vLLM-Omni's pipeline samples a request of several outputs
  (`num_outputs_per_prompt`, one prompt group) with its conditioning repeated per output;
  where not (its SD3's), the engine sends a request per image;
- `forward_arguments`: what vLLM-Omni's `forward` of the family takes as arguments instead of
  reading it from the request (FLUX.1 Kontext's text length);
- `prepare`: what vLLM-Omni's pipeline needs changed before our scheduler takes its place
  (Wan's builds its own UniPC solver; ours steps the checkpoint's Euler flow).

No vLLM import here: the facts are plain data and functions, tested without the engine env.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from omni.models.packing import pack, unpack

# {plain module leaf: (vLLM-Omni's module leaf, shard)}: SD3's, FLUX's and Qwen-Image's fusion
QKV_FUSED: Dict[str, Tuple[str, str]] = {
    "to_q": ("to_qkv", "q"),
    "to_k": ("to_qkv", "k"),
    "to_v": ("to_qkv", "v"),
    "add_q_proj": ("add_kv_proj", "q"),
    "add_k_proj": ("add_kv_proj", "k"),
    "add_v_proj": ("add_kv_proj", "v"),
}
# what the native backend calls on vLLM-Omni's pipeline: its denoising loop's scheduler step,
# `diffuse` and `forward` (extended), the transformer's `load_weights` (which declares the fused
# projections) and the text encoding
PIPELINE_HOOKS = ("diffuse", "forward", "scheduler_step", "prepare_timesteps", "load_weights", "encode_prompt")


def unpacked_step_noise(generators: Sequence[torch.Generator], like: torch.Tensor) -> torch.Tensor:
    """One standard normal latent of `like`'s shape per generator (an unpacked family's noise)."""
    return torch.stack([torch.randn(like.shape[1:], generator=g) for g in generators])


def packed_step_noise(generators: Sequence[torch.Generator], like: torch.Tensor) -> torch.Tensor:
    """A packed family's noise (FLUX, Qwen-Image: (B, tokens, 4C), one token per 2x2 patch):
    drawn unpacked, (C, 2h, 2w) per image, then packed, as its initial latent is drawn."""
    return pack(unpacked_step_noise(generators, unpack(like)))


class NativePipeline:
    """One family's facts for the native backend; a family subclasses it in its own module."""

    pipeline: str = ""  # vLLM-Omni's pipeline class, by qualified name
    # False: vLLM-Omni has the pipeline, but the native backend does not extend it yet
    extended: bool = True
    hooks: Tuple[str, ...] = PIPELINE_HOOKS
    fused: Dict[str, Tuple[str, str]] = QKV_FUSED
    # ((plain module path part, vLLM-Omni's), ...)
    renamed: Tuple[Tuple[str, str], ...] = ()
    # ((plain root parameter, vLLM-Omni's full name), ...)
    renamed_parameters: Tuple[Tuple[str, str], ...] = ()
    cond_arguments: Tuple[str, ...] = ()
    groups_outputs: bool = True
    post_process: str = "passes"  # an `omni.rollout.vllm_protocol.POST_PROCESSES`
    noise = staticmethod(unpacked_step_noise)

    def transformer_problem(self, config: dict) -> Optional[str]:
        """What in a transformer config (diffusers' config.json) vLLM-Omni's transformer of the
        family computes otherwise than diffusers' (so its samples would not be the trained
        policy's), or None."""
        return None

    def prepare(self, pipe: Any) -> None:
        """Called on vLLM-Omni's pipeline at start-up, before `FlowGRPOScheduler` is built from
        `pipe.scheduler.config`: whatever the pipeline needs for that scheduler to be the
        family's (nothing, for a pipeline that loads the checkpoint's scheduler)."""

    def forward_arguments(self, options) -> Dict[str, Any]:
        """Keyword arguments for vLLM-Omni's `forward` of the family, from the rollout's
        `SamplingOptions`: what it does not read from the request's sampling params."""
        return {}

    def fused_module(self, plain: str) -> Optional[Tuple[str, str]]:
        """(vLLM-Omni's fused module path, shard) of a plain module path whose projection is
        fused (`fused`: its last two path parts or its leaf), else None."""
        parent, _, leaf = plain.rpartition(".")
        tail = f"{parent.rpartition('.')[2]}.{leaf}"
        if tail in self.fused:  # a rule for one attention: the fused layer sits beside it
            fused, shard = self.fused[tail]
        elif leaf in self.fused:
            fused, shard = self.fused[leaf]
        else:
            return None
        return (f"{parent}.{fused}" if parent else fused), shard

    @property
    def class_name(self) -> str:
        """vLLM-Omni's pipeline class's own name (`StableDiffusion3Pipeline`)."""
        return self.pipeline.rpartition(".")[2]

    def timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep for fp32 noise levels, as the family's actor computes it."""
        raise NotImplementedError(f"{type(self).__name__} states no transformer timestep")

    def conditioning(self, family, given: Dict[str, Optional[torch.Tensor]], max_sequence_length: int):
        """The family's conditioning from the `cond_arguments` `diffuse` was given."""
        return family.conditioning(*given.values())

    def encode_prompts(self, pipe: Any, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int):
        """The family's conditioning (on the CPU) from vLLM-Omni's text encoders of `pipe`,
        our extension of its pipeline (`pipe.family`: the family)."""
        raise NotImplementedError(f"{type(self).__name__} encodes no prompts")
