#!/usr/bin/env bash
# GPU check of the dflash kernels, the torch-cuda engine and its serving (see scripts/gpu_check.py). Run from the
# repository root on a machine with an NVIDIA GPU, torch and triton; prints one JSON line per measurement. Under 8
# minutes on an H200.
#
# The project is installed into $PYTHON's environment (pip, offline, without its dependencies: the GPU machine's
# torch stays) unless it is there already, so tritonserver's Python-backend stubs import it as they import torch.
# A GPU machine without network gets what it lacks from .gpu-carry/, prepared on a machine that has it:
#   python scripts/gpu_check.py --prepare .gpu-carry/pair     # the tiny pair and its CPU engine's outputs (CPU)
#   .gpu-carry/env/*.whl                                       # dependencies the environment lacks (pydantic ...)
#   .gpu-carry/client/*.whl, .gpu-carry/tritonserver.tar.xz    # for the served check only, kept out of the
#                                                              # environment: pytriton's tritonserver, tritonclient
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
install=(-m pip install -q --no-index --no-deps --no-compile)
if ! "$PYTHON" -c 'import dflash_trt.runtime' 2> /dev/null; then
  if compgen -G ".gpu-carry/env/*.whl" > /dev/null; then "$PYTHON" "${install[@]}" .gpu-carry/env/*.whl; fi
  "$PYTHON" "${install[@]}" --no-build-isolation .
fi
site=/tmp/dflash-gpu-site
mkdir -p "$site"
if compgen -G ".gpu-carry/client/*.whl" > /dev/null; then "$PYTHON" "${install[@]}" --target "$site" .gpu-carry/client/*.whl; fi
[ -f .gpu-carry/tritonserver.tar.xz ] && tar -xJf .gpu-carry/tritonserver.tar.xz -C "$site"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$site
pair=()
[ -f .gpu-carry/pair/expected.json ] && pair=(--pair .gpu-carry/pair)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import sys, torch; print({"python": sys.version.split()[0], "torch": torch.__version__})'
timeout 420 "$PYTHON" scripts/gpu_check.py "${pair[@]}" "$@"
