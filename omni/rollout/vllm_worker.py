"""The vLLM-Omni worker extension of our engine: RPCs that reach our pipeline in the worker.

Imported only inside the engine process (vLLM-Omni resolves
`worker_extension_cls="omni.rollout.vllm_worker.OmniRolloutWorkerExtension"` there).
vLLM-Omni mixes the extension into its diffusion worker; the engine process calls its
methods with `AsyncOmni.collective_rpc(method, args=...)`, which vLLM-Omni runs between
scheduler steps, never during a forward. It extends `CustomPipelineWorkerExtension`
because, once a worker extension is given, that class is what builds a custom pipeline.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

WORKER_EXTENSION_CLASS = "omni.rollout.vllm_worker.OmniRolloutWorkerExtension"


class OmniRolloutWorkerExtension(CustomPipelineWorkerExtension):
    def _rollout_pipeline(self):
        pipeline = self.model_runner.pipeline
        if not hasattr(pipeline, "sync_weights_from"):
            raise RuntimeError(f"the worker runs {type(pipeline).__name__}, not omni's FlowGRPOPipeline")
        return pipeline

    def omni_sync_weights(self, path: str) -> Dict[str, Any]:
        """Load a base or LoRA weight directory written by omni.rollout.transport."""
        return self._rollout_pipeline().sync_weights_from(path)

    def omni_has_base(self) -> bool:
        return self._rollout_pipeline().has_base

    def omni_encode_prompts(self, prompts: Sequence[str], guidance_scale: float, max_sequence_length: int) -> Dict[str, torch.Tensor]:
        cond = self._rollout_pipeline().encode_prompts(list(prompts), guidance_scale, max_sequence_length)
        return cond.tensors()

    def omni_encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self._rollout_pipeline().encode_images(images)
