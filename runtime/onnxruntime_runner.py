"""The ONNX Runtime runner: the CPU engine. Runs the exported graphs as ORT sessions through IO binding, so the
engine's state pool is read where it lies (bound by address, never copied into ORT) and only the rows a graph
computes come back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from dflash_trt.runtime.graph_io import GRAPH_NAMES, TensorSpec, graph_inputs, graph_outputs
from dflash_trt.runtime.states import StateSpec

NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}


@dataclass(frozen=True)
class SessionSettings:
    """ONNX Runtime session settings written into the engine manifest by dflash-build."""

    intra_op_threads: int = 0  # 0 = one per core this process may run on (a replica pinned to one core: 1)
    graph_optimization: str = "all"  # "disable" | "basic" | "extended" | "all"

    @property
    def threads(self) -> int:
        return self.intra_op_threads or len(os.sched_getaffinity(0))

    def options(self) -> ort.SessionOptions:
        levels = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[self.graph_optimization]
        options.log_severity_level = 3
        options.intra_op_num_threads = self.threads
        # The graphs of one engine alternate from step to step (step, verify, prefill), each session with its own
        # thread pool. A pool spins for a while after its run; on a small CPU the next session's run then competes
        # with it (SmolLM2-135M, 2 cores: a 1-token verify right after a step took 69 ms instead of 30). Spin
        # during a run, stop at its end: 28 ms.
        options.add_session_config_entry("session.force_spinning_stop", "1")
        return options


class OnnxRuntimeRunner:
    """`pad_single_rows`: run a call that computes one target row (batch 1, one token) as two identical rows and
    return the first: for kernels whose one-row path rounds differently from their many-row one (see
    builder.quantize.pad_single_rows), so that a token's bits never depend on how many rows its call had."""

    def __init__(
        self,
        directory: Path,
        states: tuple[StateSpec, ...],
        settings: SessionSettings = SessionSettings(),
        pad_single_rows: bool = False,
    ) -> None:
        # ONNX Runtime owns the cores; the host's torch work is small bookkeeping (row writes, slices), and a torch
        # thread pool next to ORT's spinning one oversubscribes the cores.
        torch.set_num_threads(1)
        options = settings.options()
        self.sessions = {
            name: ort.InferenceSession(str(directory / f"{name}.onnx"), options, providers=["CPUExecutionProvider"])
            for name in GRAPH_NAMES
        }
        self.output_names = {name: [t.name for t in graph_outputs(name, states)] for name in GRAPH_NAMES}
        self.pad_single_rows = pad_single_rows
        # where each graph's inputs and outputs have their batch axis (None: no batch axis)
        self.batch_axes = {
            name: {t.name: _batch_axis(t) for t in (*graph_inputs(name, states), *graph_outputs(name, states))}
            for name in GRAPH_NAMES
        }

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.pad_single_rows or inputs["input_ids" if graph == "prefill" else "block"].shape != (1, 1):  # [B, P or V]
            return self._run(graph, inputs)
        axes = self.batch_axes[graph]
        doubled = {name: _repeat_twice(tensor, axes[name]) for name, tensor in inputs.items()}  # the same row twice
        return {name: _first_row(tensor, axes[name]) for name, tensor in self._run(graph, doubled).items()}

    def _run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        session = self.sessions[graph]
        binding = session.io_binding()
        held = []  # contiguous copies of non-contiguous inputs must outlive the run
        for name, tensor in inputs.items():
            if tensor.numel() == 0:
                binding.bind_cpu_input(name, np.empty(tuple(tensor.shape), dtype=NUMPY_TYPES[tensor.dtype]))
                continue
            contiguous = tensor.contiguous()
            held.append(contiguous)
            binding.bind_input(name, "cpu", 0, NUMPY_TYPES[contiguous.dtype], tuple(contiguous.shape), contiguous.data_ptr())
        for name in self.output_names[graph]:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {name: torch.from_numpy(value.numpy()) for name, value in zip(self.output_names[graph], outputs, strict=True)}


def _batch_axis(tensor: TensorSpec) -> int | None:
    return tensor.axes.index("batch") if "batch" in tensor.axes else None


def _repeat_twice(tensor: torch.Tensor, axis: int | None) -> torch.Tensor:
    return tensor if axis is None else torch.cat([tensor, tensor], dim=axis)


def _first_row(tensor: torch.Tensor, axis: int | None) -> torch.Tensor:
    return tensor if axis is None else tensor.narrow(axis, 0, 1)
