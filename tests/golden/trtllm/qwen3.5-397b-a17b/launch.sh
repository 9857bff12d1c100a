#!/usr/bin/env bash
# Serve this repository with TensorRT-LLM 1.4.0rc1 (written by dflash-build --backend trtllm).
# Run it inside nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 on a machine with 8 GPU(s), with the repository mounted, e.g.
#   docker run --gpus all --ipc=host -p 8000:8000 -p 8001:8001 -p 8002:8002 -v $PWD/REPO:/repo \
#     nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 bash -c 'pip install dflash-trt && /repo/launch.sh'
# It checks what it needs, copies the repository to a writable directory ($DFLASH_TRT_WORKDIR, default a new
# temporary one: the mount may be read-only), adds the llmapi model's code from the container (never from this
# project) beside our model.yaml there, and starts tritonserver on it with any arguments given here appended;
# gRPC :8001, HTTP :8000, metrics :8002 (as dflash-serve).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
llmapi="${LLMAPI_MODEL_DIR:-/app/all_models/llmapi/tensorrt_llm}"
if [ ! -f "$llmapi/config.pbtxt" ] || [ ! -f "$llmapi/1/model.py" ]; then
  echo "launch.sh: no llmapi model at $llmapi: run this inside nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (or set LLMAPI_MODEL_DIR)" >&2
  exit 2
fi
if ! python3 -c "import tensorrt_llm" 2>/dev/null; then
  echo "launch.sh: TensorRT-LLM is not importable here: use nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (it needs TensorRT-LLM 1.4.0rc1 or later)" >&2
  exit 2
fi
if ! python3 -c "import dflash_trt" 2>/dev/null; then
  echo "launch.sh: the ensemble model needs this project: pip install dflash-trt inside the container" >&2
  exit 2
fi
work="${DFLASH_TRT_WORKDIR:-$(mktemp -d)}"
mkdir -p "$work"
cp -a "$here/." "$work/"
cp "$llmapi/config.pbtxt" "$work/tensorrt_llm/config.pbtxt"
find "$llmapi/1" -maxdepth 1 -type f ! -name model.yaml -exec cp {} "$work/tensorrt_llm/1/" \;
export LLM_CONFIG_PATH="$work/tensorrt_llm/1/model.yaml"
exec tritonserver --model-repository="$work" --http-port=8000 --grpc-port=8001 --metrics-port=8002 "$@"
