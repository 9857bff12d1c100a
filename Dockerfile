# dflash-trt on a GPU: the NVIDIA Triton Inference Server image carries tritonserver, the Python backend, CUDA
# and TensorRT. This image cannot be built in the CPU-only environment dflash-trt is developed in, and has not been.
#
#   docker build -t dflash-trt .
#   # build: torch-cuda engines (the pair's checkpoints, run by torch on the GPU; what the runtime serves on a GPU today)
#   docker run --rm --gpus all -v /models:/models dflash-trt \
#       dflash-build --model /models/Qwen3-8B --drafter /models/Qwen3-8B-DFlash-b16 --backend torch-cuda --output /models/qwen3-8b-dflash
#   # serve (gRPC 8001, HTTP 8000, metrics 8002):
#   docker run --rm --gpus all -p 8000-8002:8000-8002 -v /models:/models dflash-trt dflash-serve /models/qwen3-8b-dflash
#   # stream a completion from the host (pip install dflash-trt there):
#   dflash-client "Write a function that reverses a string." --stats
#
# --backend tensorrt builds TensorRT plans with the image's own TensorRT; the runtime's TensorRT runner for them is written
# against the real API but has never run (no TensorRT where dflash-trt is developed): prefer torch-cuda until it has.
ARG TRITON_VERSION=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# The gpu extra: no tritonserver and no TensorRT from pip (the image's own are used; one TensorRT version).
COPY . /opt/dflash-trt
RUN pip install --no-cache-dir "/opt/dflash-trt[gpu]"

ENV HF_HUB_OFFLINE=1
EXPOSE 8000 8001 8002
CMD ["dflash-serve", "/models/repo"]
