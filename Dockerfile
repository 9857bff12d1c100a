# dflash-trt on a GPU: the NVIDIA Triton Inference Server image carries tritonserver, the Python backend,
# CUDA and TensorRT. This image cannot be built in the CPU-only environment dflash-trt is developed in.
#
#   docker build -t dflash-trt .
#   # build engines inside the container, next to the checkpoints:
#   docker run --rm --gpus all -v /models:/models dflash-trt \
#       dflash-build --model /models/Qwen3-8B --drafter /models/Qwen3-8B-DFlash-b16 --backend tensorrt --output /models/qwen3-8b-dflash
#   # serve it (gRPC 8001, HTTP 8000, metrics 8002):
#   docker run --rm --gpus all -p 8000-8002:8000-8002 -v /models:/models dflash-trt dflash-serve /models/qwen3-8b-dflash
ARG TRITON_VERSION=25.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# The TensorRT Python API and the Triton-language compiler for the dflash plugins' AOT kernels.
RUN pip install --no-cache-dir "tensorrt-cu12>=10.13" "triton==3.9.0"

COPY . /opt/dflash-trt
RUN pip install --no-cache-dir /opt/dflash-trt

ENV HF_HUB_OFFLINE=1
EXPOSE 8000 8001 8002
CMD ["dflash-serve", "/models/repo"]
