"""Which families and vLLM-Omni versions `rollout.options.backend=native` supports, checked
before any model loads.

The native backend (`omni.rollout.vllm_native`) extends vLLM-Omni's own pipeline of the
family through hooks that pipeline has: its `scheduler` (stepped by its denoising loop via
`scheduler_step`), `diffuse`, `forward`, the transformer's `load_weights` (which declares
the fused projections), and the worker's LoRA manager with per-request `lora_request`.
`hook_problems` looks for each of them in the installed vLLM-Omni; it runs in the engine's
environment (`python -m omni.rollout.native_support FAMILY`), which the driver calls
through `native_problem` at validation.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

NATIVE_PIPELINE_CLASSES = {
    "sd3": "omni.rollout.vllm_native.NativeSD3Pipeline",
    "flux": "omni.rollout.vllm_native.NativeFluxPipeline",
    "qwen_image": "omni.rollout.vllm_native.NativeQwenImagePipeline",
}
# vLLM-Omni's pipelines for other families of ours, not yet extended by a native pipeline of ours
NOT_YET_NATIVE = {"wan": "WanPipeline"}
# the vLLM-Omni releases whose pipelines the native backend was checked against
TESTED_VERSIONS = ("0.30",)
# family -> (vLLM-Omni's pipeline class, the attributes the native backend uses)
PIPELINE_HOOKS = ("diffuse", "forward", "scheduler_step", "prepare_timesteps", "load_weights", "encode_prompt")
HOOKS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "sd3": ("vllm_omni.diffusion.models.sd3.pipeline_sd3.StableDiffusion3Pipeline", PIPELINE_HOOKS),
    "flux": ("vllm_omni.diffusion.models.flux.pipeline_flux.FluxPipeline", PIPELINE_HOOKS),
    "qwen_image": ("vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image.QwenImagePipeline", PIPELINE_HOOKS),
}
# prompt fields of a request (vLLM-Omni's OmniTextPrompt) among a family's pipeline guidance
PROMPT_FIELDS = ("negative_prompt",)
ENGINE_HOOKS = (
    ("vllm_omni.diffusion.worker.diffusion_worker.CustomPipelineWorkerExtension", ()),
    ("vllm_omni.diffusion.worker.diffusion_worker.DiffusionWorker", ("add_lora", "init_lora_manager")),
    ("vllm_omni.inputs.data.OmniDiffusionSamplingParams", ("lora_request", "generator_device", "output_type")),
)


def supported() -> str:
    return f"supported: model.family in {sorted(NATIVE_PIPELINE_CLASSES)} with vLLM-Omni {', '.join(v + '.x' for v in TESTED_VERSIONS)}"


def family_problem(family: str) -> Optional[str]:
    """Why `family` has no native backend (None when it has one); no vLLM-Omni needed."""
    if family in NATIVE_PIPELINE_CLASSES:
        return None
    detail = (
        f"vLLM-Omni has a {NOT_YET_NATIVE[family]} but omni-recipes does not extend it yet"
        if family in NOT_YET_NATIVE
        else "vLLM-Omni has no pipeline for it that omni-recipes extends"
    )
    return f"rollout.options.backend=native: model.family={family}: {detail}; {supported()}; or use rollout.options.backend=vllm"


def request_guidance(family: str, guidance_scale: float) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(prompt fields, sampling-params fields) that make vLLM-Omni's pipeline of `family`
    guide as our family does: the family's pipeline guidance (`pipeline_guidance`, e.g.
    Qwen-Image's negative prompt " " and `true_cfg_scale`) split between the prompt and the
    sampling params. Without a second pass (`forward_passes` 1) no negative prompt: vLLM-Omni's
    Qwen-Image runs true CFG whenever a request has one, taking a scale of 0 for 4."""
    from omni.models import get_family

    model = get_family(family)
    fields = model.pipeline_guidance(guidance_scale)
    prompt = {k: fields.pop(k) for k in PROMPT_FIELDS if k in fields}
    return (prompt if model.forward_passes(guidance_scale) > 1 else {}), fields


def _resolve(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def missing_hooks(cls, attributes) -> List[str]:
    """The attributes `cls` lacks (a dataclass's fields count as attributes)."""
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    return [a for a in attributes if not hasattr(cls, a) and a not in fields]


def hook_problems(family: str) -> Optional[str]:
    """In the engine env: what the installed vLLM-Omni lacks for the native backend, or None."""
    problem = family_problem(family)
    if problem:
        return problem
    import vllm_omni

    version = getattr(vllm_omni, "__version__", "unknown")
    missing = []
    for qualname, attributes in (HOOKS[family], *ENGINE_HOOKS):
        try:
            cls = _resolve(qualname)
        except (ImportError, AttributeError) as error:
            missing.append(f"{qualname} ({error.__class__.__name__})")
            continue
        missing += [f"{qualname}.{a}" for a in missing_hooks(cls, attributes)]
    if missing:
        return f"rollout.options.backend=native: vLLM-Omni {version} lacks {missing}; {supported()}"
    return None


@functools.lru_cache(maxsize=None)
def native_problem(python: str, family: str) -> Optional[str]:
    """Driver side: `hook_problems` run by the engine env's python (it has vLLM-Omni)."""
    problem = family_problem(family)
    if problem:
        return problem
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([python, "-m", "omni.rollout.native_support", family], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return f"rollout.options.backend=native: checking vLLM-Omni with {python} failed: {' | '.join(tail)}"
    answer = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return None if answer == "ok" else answer


def main(argv=None) -> None:
    (family,) = argv if argv is not None else sys.argv[1:]
    print(hook_problems(family) or "ok")


if __name__ == "__main__":
    main()
