"""Our pipeline class for vLLM-Omni: Flow-GRPO SDE sampling with log-probs, for any model family.

vLLM-Omni has no SDE sampler and reports no log-probs, but runs a custom pipeline class
(`custom_pipeline_args={"pipeline_class": "omni.rollout.vllm_pipeline.FlowGRPOPipeline"}`).
This is that class. It wraps our in-process engine (`DiffusersEngine`: the family's diffusers
components, PEFT LoRA on the transformer) and samples with the very function the
in-process engine uses, so its log-probs equal the diffusers engine's for the same model,
seeds and weights. vLLM-Omni contributes the serving: its process, request scheduling
and co-batching, device placement, RPC into the worker.

Nothing here imports vLLM: `forward` imports vLLM-Omni's `DiffusionOutput` when called
(inside the engine), and everything else runs and is tested on a CPU without vLLM.
Weights arrive as directories from `omni.rollout.transport` (the worker extension in
`omni.rollout.vllm_worker` calls `sync_weights_from`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from omni.models import get_family
from omni.rollout.base import RolloutBatch, SamplingOptions
from omni.rollout.diffusers_engine import load_diffusers_engine
from omni.rollout.transport import read_weights
from omni.rollout.vllm_protocol import group_by_options, output_fields, prompt_text, request_rows

PIPELINE_CLASS = "omni.rollout.vllm_pipeline.FlowGRPOPipeline"


class FlowGRPOPipeline(torch.nn.Module):
    """Built by vLLM-Omni as `FlowGRPOPipeline(od_config=...)` on the CPU, then moved to
    the device with `.to()`. Reads `od_config.model`, `od_config.dtype` and our
    `od_config.custom_pipeline_args`: "family" (`model.family`), "load_base" (False: a
    dummy transformer until the first weight sync) and "vae_inversion_steps"
    (`model.vae_inversion_steps`)."""

    # vLLM-Omni hands us a whole batch of co-scheduled requests per forward.
    supports_request_batch = True
    # Component names for vLLM-Omni's discovery (offloading, memory accounting).
    _dit_modules = ["transformer"]
    _vae_modules = ["vae"]

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__()
        self.od_config = od_config
        args = od_config.custom_pipeline_args or {}
        # micro_batch_size is per call: each forward samples its requests in one pass.
        if "family" not in args:
            raise ValueError("custom_pipeline_args needs 'family' (model.family), e.g. {'family': 'sd3'}")
        family = get_family(args["family"])
        self.engine = load_diffusers_engine(
            family,
            od_config.model,
            torch.device("cpu"),
            od_config.dtype,
            micro_batch_size=1,
            load_base=args.get("load_base", True),
            vae_inversion_steps=args.get("vae_inversion_steps", 0),
        )
        pipe = self.engine.pipe
        # Registered as submodules so vLLM-Omni's `.to(device)` moves them.
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self._encoder_modules = list(family.text_encoders)
        for name in family.text_encoders:
            setattr(self, name, getattr(pipe, name))

    # ----------------------------------------------------------------- loading
    def load_weights(self, weights: Iterable) -> Optional[set]:
        """vLLM-Omni's loader hook. The components loaded themselves in __init__ and we
        declare no `weights_sources`, so this receives nothing at start; returning None
        skips the loader's check that every parameter came from a checkpoint."""
        for _ in weights:
            raise ValueError("FlowGRPOPipeline loads its weights itself; sync them with sync_weights_from")
        return None

    def sync_weights_from(self, path: str) -> Dict[str, Any]:
        """Load a weight directory (base or LoRA) written by `omni.rollout.transport`; after a
        LoRA, the answer lists the modules the adapter is bound to (`lora_modules`)."""
        kind, tensors, lora = read_weights(path)
        self.engine.update_weights(tensors, base_sync_done=kind == "lora", lora=lora)
        answer = {"kind": kind, "tensors": len(tensors), "has_base": self.engine.has_base}
        return {**answer, "lora_modules": self.engine.lora_modules} if kind == "lora" else answer

    @property
    def has_base(self) -> bool:
        return self.engine.has_base

    # ----------------------------------------------------------------- sampling
    def _on_device(self):
        # vLLM-Omni moved the modules after __init__; the engine samples where they are.
        self.engine.device = self.engine.prompts.device = self.transformer.device
        return self.engine

    def sample(self, prompts: Sequence[str], seeds: Sequence[int], options: SamplingOptions) -> RolloutBatch:
        engine = self._on_device()
        engine.micro_batch_size = max(1, len(prompts))
        return engine.generate(prompts, seeds, options)

    def forward_fields(self, batch) -> List[Dict[str, Any]]:
        """`DiffusionOutput` fields for each request of a vLLM-Omni request batch (anything
        with `.prompts` and `.sampling_params_list`), in the batch's order: all their outputs
        sampled in one pass, each with its seed."""
        texts = [prompt_text(p) for p in batch.prompts]
        params = batch.sampling_params_list
        fields: List[Optional[Dict[str, Any]]] = [None] * len(texts)
        for options, requests in group_by_options(texts, params):
            prompts, seeds, spans = request_rows(texts, params, requests)
            sampled = self.sample(prompts, seeds, options)
            for i, (start, stop) in zip(requests, spans):
                fields[i] = output_fields(sampled, range(start, stop))
        return fields

    def forward(self, batch) -> list:
        from vllm_omni.diffusion.data import DiffusionOutput

        return [DiffusionOutput(**fields) for fields in self.forward_fields(batch)]

    # ----------------------------------------------------------------- encoding (DPO)
    def encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int):
        return self._on_device().encode_prompts(prompts, guidance_scale, max_sequence_length)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self._on_device().encode_images(images)
