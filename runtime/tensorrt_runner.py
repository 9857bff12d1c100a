"""The TensorRT runner: built plans executed on a CUDA GPU, behind the same GraphEngine as every backend.

Written against the real TensorRT Python API and type-checked with mypy against `tensorrt-stubs` (as the build
layer is); TensorRT cannot be installed where this toolkit is developed, so it has never run. Per graph: one
deserialized engine (the dflash plugins registered first); per call: input shapes set from the tensors (within the
plans' optimization profiles), inputs and outputs as CUDA torch tensors bound by address, `execute_async_v3` on the
current torch stream. The batched graphs (step, verify, decode) are padded to a bucket of rows (within the profiles'
batch range), captured as CUDA graphs per input shape and replayed (`cuda_graphs.CudaGraphCalls`, as the torch-cuda
backend's are): each captured shape has its own execution context, since a captured graph keeps the shapes and
addresses its context had, and every context uses one shared activation buffer (calls never run at the same time).
The rows a graph computes for the state pool stay on the GPU (the engine writes them into the pool there); the other
outputs come back to the CPU for the scheduler. Not done: binding the pool's own rows as outputs (in-place aliasing).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from dflash_trt.runtime.cuda_graphs import CAPTURED_GRAPHS, BatchPadding, CudaGraphCalls
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
        for graph in GRAPH_NAMES:
            plan = engine_dir / f"{graph}.plan"
            engine = runtime.deserialize_cuda_engine(plan.read_bytes())
            if engine is None:
                raise RuntimeError(f"TensorRT could not deserialize {plan} (built by another TensorRT version or GPU?)")
            self.engines[graph] = engine
        self.names = {
            g: ([t.name for t in graph_inputs(g, spec.states)], [t.name for t in graph_outputs(g, spec.states)])
            for g in GRAPH_NAMES
        }
        activation_bytes = max(engine.device_memory_size_v2 for engine in self.engines.values())
        self.activations = torch.empty(activation_bytes, dtype=torch.uint8, device=device)  # every context's scratch
        self.contexts: dict[tuple[str, object], trt.IExecutionContext] = {}
        self.cuda_graphs: CudaGraphCalls | None = CudaGraphCalls(device)  # None: eager
        self.padding = {g: BatchPadding.of(g, spec.states, spec.max_batch_size) for g in CAPTURED_GRAPHS}  # the profiles' max

    @torch.inference_mode()
    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        input_names, output_names = self.names[graph]
        values = [inputs[name] for name in input_names]
        if self.cuda_graphs is not None and graph in CAPTURED_GRAPHS:
            outputs = self.cuda_graphs.run(graph, partial(self._execute_captured, graph), values, self.padding[graph])
        else:  # prefill (its shapes follow each prompt): one context per graph, its shapes set per call
            outputs = self._execute(graph, self._context(graph, None), *(v.to(self.device) for v in values))
        return {name: value if name.endswith("_rows") else value.cpu() for name, value in zip(output_names, outputs, strict=True)}

    def _execute_captured(self, graph: str, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_execute` in the context of these input shapes: a replay does not call it, only a shape's first call, the
        capture's warm-up and the capture itself."""
        return self._execute(graph, self._context(graph, tuple(tuple(v.shape) for v in values)), *values)

    def _context(self, graph: str, shapes: object) -> trt.IExecutionContext:
        """The execution context of a graph at these input shapes (None: any), on the shared activation buffer."""
        key = (graph, shapes)
        if key not in self.contexts:
            context = self.engines[graph].create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            context.set_device_memory(self.activations.data_ptr(), self.activations.numel())
            self.contexts[key] = context
        return self.contexts[key]

    def _execute(self, graph: str, context: trt.IExecutionContext, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Bind device `values` as the graph's inputs and fresh tensors as its outputs; enqueue on the current stream."""
        engine = self.engines[graph]
        input_names, output_names = self.names[graph]
        bound = [value.contiguous() for value in values]  # kept alive until the outputs are read
        for name, tensor in zip(input_names, bound, strict=True):
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"{graph}: input {name} of shape {tuple(tensor.shape)} is outside the plan's profile")
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in output_names:
            dims = context.get_tensor_shape(name)  # known from the input shapes just set
            shape = [dims[axis] for axis in range(len(dims))]
            tensor = torch.empty(shape, dtype=_torch_dtype(engine.get_tensor_dtype(name)), device=self.device)
            context.set_tensor_address(name, tensor.data_ptr())
            outputs.append(tensor)
        if not context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError(f"TensorRT failed to enqueue the {graph} graph")
        return tuple(outputs)
