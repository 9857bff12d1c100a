"""The TensorRT runner: built plans executed on a CUDA GPU, behind the same GraphEngine as every backend.

Written against the real TensorRT Python API and type-checked with mypy against `tensorrt-stubs` (as the build
layer is); TensorRT cannot be installed where this toolkit is developed, so it has never run. Per graph: one
deserialized engine (the dflash plugins registered first) and one execution context; per call: input shapes set
from the tensors (within the plans' optimization profiles), inputs and outputs as CUDA torch tensors bound by
address, `execute_async_v3` on a torch stream. The rows a graph computes for the state pool stay on the GPU (the
engine writes them into the pool there); the other outputs come back to the CPU for the scheduler. Not done: CUDA
graph capture per (batch, length) bucket, and binding the pool's own rows as outputs (in-place aliasing).
"""

from __future__ import annotations

from pathlib import Path

import torch
from dflash_trt.runtime.engine import EngineSpec
from dflash_trt.runtime.graph_io import GRAPH_NAMES, graph_inputs, graph_outputs

try:
    import tensorrt as trt
except ImportError:  # not installable here
    trt = None  # type: ignore[assignment]


def tensorrt_runtime_available() -> bool:
    """TensorRT's runtime (not only `tensorrt-stubs`, which makes `import tensorrt` an empty package) and a GPU."""
    return trt is not None and hasattr(trt, "Runtime") and torch.cuda.is_available()


def _torch_dtype(dtype: trt.DataType) -> torch.dtype:
    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT64: torch.int64,
        trt.DataType.INT32: torch.int32,
        trt.DataType.BOOL: torch.bool,
    }
    if dtype not in table:
        raise RuntimeError(f"a dflash plan has a tensor of TensorRT type {dtype}, which this runner does not bind")
    return table[dtype]


class TensorRTRunner:
    """Executes the plans of an engine directory (`{graph}.plan`) on `device`."""

    def __init__(self, engine_dir: Path, spec: EngineSpec, device: torch.device) -> None:
        if not tensorrt_runtime_available():
            raise RuntimeError(
                f"{engine_dir} holds TensorRT plans: serving them needs TensorRT 10+ and a CUDA GPU (run inside the "
                "NVIDIA Triton container on a GPU), or rebuild with --backend torch-cuda (GPU) / onnxruntime (CPU)"
            )
        from dflash_trt.plugins.tensorrt_plugins import register_tensorrt_plugins

        register_tensorrt_plugins()  # the plans' dflash:: layers are these plugins
        self.device = device
        self.logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self.logger)
        self.engines: dict[str, trt.ICudaEngine] = {}
        self.contexts: dict[str, trt.IExecutionContext] = {}
        for graph in GRAPH_NAMES:
            plan = engine_dir / f"{graph}.plan"
            engine = runtime.deserialize_cuda_engine(plan.read_bytes())
            if engine is None:
                raise RuntimeError(f"TensorRT could not deserialize {plan} (built by another TensorRT version or GPU?)")
            self.engines[graph] = engine
            self.contexts[graph] = engine.create_execution_context()
        self.names = {
            g: ([t.name for t in graph_inputs(g, spec.states)], [t.name for t in graph_outputs(g, spec.states)])
            for g in GRAPH_NAMES
        }
        self.stream = torch.cuda.Stream(device)

    @torch.inference_mode()
    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        engine, context = self.engines[graph], self.contexts[graph]
        input_names, output_names = self.names[graph]
        bound = {name: inputs[name].to(self.device).contiguous() for name in input_names}  # kept alive until done
        for name, tensor in bound.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"{graph}: input {name} of shape {tuple(tensor.shape)} is outside the plan's profile")
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in output_names:
            dims = context.get_tensor_shape(name)  # known from the input shapes just set
            shape = [dims[axis] for axis in range(len(dims))]
            outputs[name] = torch.empty(shape, dtype=_torch_dtype(engine.get_tensor_dtype(name)), device=self.device)
            context.set_tensor_address(name, outputs[name].data_ptr())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the inputs' copies are queued there
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to enqueue the {graph} graph")
        self.stream.synchronize()
        return {name: value if name.endswith("_rows") else value.cpu() for name, value in outputs.items()}
