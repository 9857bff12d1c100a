#!/usr/bin/env bash
# GPU check of the dflash kernels and the target step (see scripts/gpu_check.py). Run from the repository root
# on a machine with an NVIDIA GPU, torch and triton; prints one JSON line per measurement. Under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=${PYTHONPATH:-}:$PWD/.gpu-path
mkdir -p .gpu-path/dflash_trt
# the package layout without installing it (the device machine has no network for pip)
for part in builder plugins runtime client model_repo; do ln -sfn "$PWD/$part" ".gpu-path/dflash_trt/$part"; done
touch .gpu-path/dflash_trt/__init__.py
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 480 "$PYTHON" scripts/gpu_check.py "$@"
