"""Which families and vLLM-Omni versions `rollout.options.backend=native` supports, checked
before any model loads.

A family is served when it states its facts for the native backend (`ModelFamily.native`,
an `omni.models.native.NativePipeline` in the family's own module): vLLM-Omni's pipeline
class of it and the hooks of that pipeline the backend uses. The native backend
(`omni.rollout.vllm_native`) extends that pipeline through hooks it has: its `scheduler`
(stepped by its denoising loop via `scheduler_step`), `diffuse`, `forward`, the
transformer's `load_weights` (which declares the fused projections), and the worker's LoRA
manager with per-request `lora_request`. `hook_problems` looks for each of them in the
installed vLLM-Omni; it runs in the engine's environment
(`python -m omni.rollout.native_support FAMILY`), which the driver calls through
`native_problem` at validation.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omni.models import FAMILIES, get_family
from omni.models.native import NativePipeline

# the module whose attributes are the native pipeline classes, one per served family
NATIVE_MODULE = "omni.rollout.vllm_native"
# the vLLM-Omni releases whose pipelines the native backend was checked against
TESTED_VERSIONS = ("0.30",)
# prompt fields of a request (vLLM-Omni's OmniTextPrompt) among a family's pipeline guidance
PROMPT_FIELDS = ("negative_prompt",)
ENGINE_HOOKS = (
    ("vllm_omni.diffusion.worker.diffusion_worker.CustomPipelineWorkerExtension", ()),
    ("vllm_omni.diffusion.worker.diffusion_worker.DiffusionWorker", ("add_lora", "init_lora_manager")),
    ("vllm_omni.inputs.data.OmniDiffusionSamplingParams", ("lora_request", "generator_device", "output_type")),
)


def native_families() -> List[str]:
    """The families whose vLLM-Omni pipeline the native backend extends."""
    return [name for name in FAMILIES.names() if _served(get_family(name).native)]


def _served(native: Optional[NativePipeline]) -> bool:
    return native is not None and native.extended


def native_facts(family: str) -> NativePipeline:
    """`model.family`'s facts for the native backend; a KeyError for a family without them."""
    native = get_family(family).native
    if not _served(native):
        raise KeyError(f"model.family={family}: the native backend does not extend vLLM-Omni's pipeline of it")
    return native


def weight_facts(family: str) -> NativePipeline:
    """`model.family`'s transformer names in vLLM-Omni (`fused`, `renamed`, ...), also for a
    pipeline not extended yet; a KeyError for a family vLLM-Omni has no pipeline of."""
    native = get_family(family).native
    if native is None:
        raise KeyError(f"model.family={family}: vLLM-Omni has no pipeline of it that omni-recipes knows")
    return native


def native_class_name(family: str) -> str:
    """Our pipeline class of `family` in `NATIVE_MODULE`: `Native` + vLLM-Omni's class name."""
    return f"Native{native_facts(family).class_name}"


def native_pipeline_class(family: str) -> str:
    """Our pipeline class of `family`, by qualified name (what vLLM-Omni is told to run)."""
    return f"{NATIVE_MODULE}.{native_class_name(family)}"


def supported() -> str:
    versions = ", ".join(v + ".x" for v in TESTED_VERSIONS)
    return f"supported: model.family in {native_families()} with vLLM-Omni {versions}"


def family_problem(family: str) -> Optional[str]:
    """Why `family` has no native backend (None when it has one); no vLLM-Omni needed."""
    try:
        native = get_family(family).native
    except KeyError:  # no such family: validation names it apart
        native = None
    if _served(native):
        return None
    detail = (
        f"vLLM-Omni has a {native.class_name} but omni-recipes does not extend it yet"
        if native is not None
        else "vLLM-Omni has no pipeline for it that omni-recipes extends"
    )
    return (
        f"rollout.options.backend=native: model.family={family}: {detail}; {supported()}; or use "
        "rollout.options.backend=vllm"
    )


def request_guidance(family: str, guidance_scale: float) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(prompt fields, sampling-params fields) that make vLLM-Omni's pipeline of `family`
    guide as our family does: the family's pipeline guidance (`pipeline_guidance`, e.g.
    Qwen-Image's negative prompt " " and `true_cfg_scale`) split between the prompt and the
    sampling params. Without a second pass (`forward_passes` 1) no negative prompt: vLLM-Omni's
    Qwen-Image runs true CFG whenever a request has one, taking a scale of 0 for 4."""
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
    native = native_facts(family)
    for qualname, attributes in ((native.pipeline, native.hooks), *ENGINE_HOOKS):
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
    done = subprocess.run(
        [python, "-m", "omni.rollout.native_support", family], capture_output=True, text=True, env=env
    )
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
