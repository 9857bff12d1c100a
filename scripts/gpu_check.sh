#!/usr/bin/env bash
# GPU check of the dflash kernels, the torch-cuda engine and its serving (see scripts/gpu_check.py). Run from the
# repository root on a machine with an NVIDIA GPU, torch and triton; prints one JSON line per measurement. Under 8
# minutes on an H200.
#
# The project is installed into $PYTHON's environment (pip, offline, without its dependencies: the GPU machine's
# torch stays) unless it is there already, so tritonserver's Python-backend stubs import it as they import torch.
# A GPU machine without network gets what it lacks from .gpu-carry/, which `python scripts/gpu_carry.py` prepares on
# a machine that has network (under the device tool's 64 MiB with the repository): pair/ (the tiny pair and its CPU
# engine's outputs), env-pyX.Y.tar.xz (wheels installed into $PYTHON's environment: NumPy < 2, pydantic ...) and
# site-pyX.Y.tar.xz (for the served check only, kept out of that environment: pytriton's tritonserver,
# tritonclient), each used only where $PYTHON is that version.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
install=(-m pip install -q --no-index --no-deps --no-compile)
version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
scratch=/tmp/dflash-gpu-carry
site=$scratch/site
mkdir -p "$scratch/env" "$site"
if ! "$PYTHON" -c 'import dflash_trt.runtime' 2> /dev/null; then
  if [ -f ".gpu-carry/env-py$version.tar.xz" ]; then
    tar -xJf ".gpu-carry/env-py$version.tar.xz" -C "$scratch/env"
    "$PYTHON" "${install[@]}" "$scratch"/env/*.whl
  fi
  "$PYTHON" "${install[@]}" --no-build-isolation .
fi
[ -f ".gpu-carry/site-py$version.tar.xz" ] && tar -xJf ".gpu-carry/site-py$version.tar.xz" -C "$site"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site
pair=()
[ -f .gpu-carry/pair/expected.json ] && pair=(--pair .gpu-carry/pair)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import sys, torch; print({"python": sys.version.split()[0], "torch": torch.__version__})'
timeout 420 "$PYTHON" scripts/gpu_check.py "${pair[@]}" "$@"
