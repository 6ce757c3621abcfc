"""The vLLM-Omni worker extension of our engine: RPCs that reach our pipeline in the worker.

Imported only inside the engine process (vLLM-Omni resolves
`worker_extension_cls="omni.rollout.vllm_worker.OmniRolloutWorkerExtension"` there).
vLLM-Omni mixes the extension into its diffusion worker; the engine process calls its
methods with `AsyncOmni.collective_rpc(method, args=...)`, which vLLM-Omni runs between
scheduler steps, never during a forward. It extends `CustomPipelineWorkerExtension`
because, once a worker extension is given, that class is what builds a custom pipeline.

With `rollout.options.backend=native` the pipeline is `omni.rollout.vllm_native`'s and
LoRA adapters go through vLLM-Omni's own LoRA manager: `omni_add_lora` loads one by path
(`add_lora`, the worker's method), and each request names it (`lora_request`).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

WORKER_EXTENSION_CLASS = "omni.rollout.vllm_worker.OmniRolloutWorkerExtension"


def native_lora_request(name: str, adapter_id: int, path: str):
    """vLLM's LoRARequest for an adapter directory (its id must be a positive integer)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int(adapter_id), lora_path=str(path))


class OmniRolloutWorkerExtension(CustomPipelineWorkerExtension):
    def _rollout_pipeline(self):
        pipeline = self.model_runner.pipeline
        if not hasattr(pipeline, "sync_weights_from"):
            raise RuntimeError(f"the worker runs {type(pipeline).__name__}, not omni's FlowGRPOPipeline")
        return pipeline

    def omni_sync_weights(self, path: str) -> Dict[str, Any]:
        """Load a base or LoRA weight directory written by omni.rollout.transport."""
        return self._rollout_pipeline().sync_weights_from(path)

    def omni_add_lora(self, name: str, adapter_id: int, path: str) -> Dict[str, Any]:
        """Load a PEFT adapter directory (omni.rollout.transport) into vLLM-Omni's LoRA manager;
        requests then select it with the same LoRARequest (`native_lora_request`)."""
        if not self._rollout_pipeline().has_base:
            raise RuntimeError("the engine got LoRA weights before any base weights; sync the base first")
        if getattr(self, "lora_manager", None) is None:
            raise RuntimeError(
                "vLLM-Omni's worker has no LoRA manager (its lora_backend is not the default): cannot load LoRA syncs"
            )
        self.add_lora(native_lora_request(name, adapter_id, path))
        return {"kind": "lora", "adapter_id": adapter_id, "has_base": True}

    def omni_has_base(self) -> bool:
        return self._rollout_pipeline().has_base

    def omni_encode_prompts(
        self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int, sources: Sequence = ()
    ) -> Dict[str, torch.Tensor]:
        """The prompts' conditioning; `sources`: each prompt's source image files (an edit's)."""
        from omni.rollout.vllm_protocol import with_sources

        prompts = with_sources(prompts, sources)
        cond = self._rollout_pipeline().encode_prompts(prompts, guidance_scale, max_sequence_length)
        return cond.tensors()

    def omni_encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self._rollout_pipeline().encode_images(images)
