"""TensorRT plans from the exported ONNX graphs (the GPU engines), with the real TensorRT Python API.

TensorRT cannot be installed in the environment this toolkit is developed in, so this layer is kept thin,
type-checked with mypy against `tensorrt-stubs` (scripts/prepare_tensorrt_stubs.py), and it fails with a
clear message where TensorRT or a GPU is missing. The dflash:: nodes become plugins: their ONNX function
bodies are stripped and the parser looks the op names up in the plugin registry (namespace "dflash"),
where plugins/tensorrt_plugins.py registers them with `tensorrt.plugin` (AOT: Triton kernels as PTX).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onnx
from dflash_trt.plugins.onnx_domain import DOMAIN, DOMAIN_VERSION
from dflash_trt.plugins.tensorrt_plugins import register_tensorrt_plugins
from dflash_trt.runtime.engine import EngineSpec
from dflash_trt.runtime.graph_io import POOL_AXIS, graph_inputs

try:
    import tensorrt as trt
except ImportError:  # not installable here: see require_tensorrt
    trt = None  # type: ignore[assignment]

TOPK_LIMIT = 3840  # TensorRT's largest TopK: bounds the sorted candidate list (top-p) on this backend
WORKSPACE_BYTES = 8 << 30


class TensorRTUnavailable(RuntimeError):
    """TensorRT (or a CUDA GPU) is not present where a TensorRT build or run was asked for."""


def tensorrt_available() -> bool:
    """With only `tensorrt-stubs` installed, `import tensorrt` gives an empty namespace package."""
    return trt is not None and hasattr(trt, "Builder")


def require_tensorrt() -> None:
    if not tensorrt_available():
        raise TensorRTUnavailable(
            "--backend tensorrt needs TensorRT 10+ and an NVIDIA GPU: build inside the NVIDIA Triton container "
            "(see the Dockerfile), or use --backend onnxruntime for the CPU engine"
        )
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("--backend tensorrt needs a CUDA GPU, and none is visible; use --backend onnxruntime")


def plugin_ready_onnx(onnx_path: Path, output_path: Path) -> None:
    """Strip the dflash function bodies so the parser maps each dflash node to the plugin of its op name."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    kept = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend(kept)
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.attribute.extend([
                onnx.helper.make_attribute("plugin_namespace", DOMAIN),
                onnx.helper.make_attribute("plugin_version", str(DOMAIN_VERSION)),
            ])  # fmt: skip
    onnx.save(model, str(output_path))  # external data keeps pointing at the shared weights file


def axis_bounds(spec: EngineSpec) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) per named dynamic axis of the graph schema."""
    return {
        "batch": (1, 1, spec.max_batch_size),
        "sampled": (0, 0, spec.max_batch_size),
        "prompt": (1, min(256, spec.max_seq_len), spec.max_seq_len),
        "verify": (1, spec.block_size, spec.block_size),
        "drafts": (1, spec.block_size - 1, spec.block_size - 1),
        "rows": (1, min(512, spec.positions), spec.positions),
        "candidates": (1, 1, min(spec.vocab_size, TOPK_LIMIT)),
        "pool_rows": (spec.max_batch_size * spec.positions,) * 3,  # x layers below: the pool, allocated once
        "pool_slots": (spec.max_batch_size,) * 3,  # a recurrent state's pool: x layers below
    }


def input_dims(name: str, spec: EngineSpec) -> dict[str, list[tuple[int, int, int]]]:
    """(min, opt, max) of every axis of every input of one graph, from the graph schema."""
    bounds = axis_bounds(spec)
    layers = {s.name: s.layers for s in spec.states}
    dims = {}
    for tensor in graph_inputs(name, spec.states):
        dims[tensor.name] = [_axis_dims(axis, bounds, layers.get(tensor.name, 1)) for axis in tensor.axes]
    return dims


def _axis_dims(axis: str, bounds: dict[str, tuple[int, int, int]], layers: int) -> tuple[int, int, int]:
    pool = next((kind for kind in POOL_AXIS.values() if axis.endswith(kind)), None)
    if pool is not None:  # a flat state pool: layers x slots (x positions) rows
        low, opt, high = bounds[pool]
        return layers * low, layers * opt, layers * high
    return bounds[axis] if axis in bounds else (int(axis),) * 3


def _progress_monitor(log_prefix: str) -> trt.IProgressMonitor:
    class Progress(trt.IProgressMonitor):
        """Prints each build phase as TensorRT enters it (long builds show progress)."""

        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            print(f"{log_prefix} {phase_name} ({num_steps} steps)", file=sys.stderr)

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # keep building

        def phase_finish(self, phase_name: str) -> None:
            pass

    return Progress()


def build_plan(onnx_path: Path, plan_path: Path, name: str, spec: EngineSpec) -> None:
    """Parse one exported graph and write its serialized TensorRT plan (strongly typed: the ONNX dtypes rule)."""
    require_tensorrt()
    register_tensorrt_plugins()  # the dflash nodes' plugins, with their kernels compiled ahead of time
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    stripped = onnx_path.with_suffix(".plugins.onnx")
    plugin_ready_onnx(onnx_path, stripped)
    if not parser.parse_from_file(str(stripped)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {stripped.name}: {errors} (are the dflash plugins registered?)")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    config.progress_monitor = _progress_monitor(f"[dflash-build] tensorrt {name}:")
    profile = builder.create_optimization_profile()
    ranges = input_dims(name, spec)
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        dims = ranges[tensor.name]
        low, opt, high = (trt.Dims([d[k] for d in dims]) for k in range(3))
        profile.set_shape(tensor.name, low, opt, high)
    config.add_optimization_profile(profile)
    began = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build {name}; rerun with TensorRT logging at VERBOSE for the reason")
    plan_path.write_bytes(bytes(plan))
    print(
        f"[dflash-build] tensorrt {name}: {plan_path.stat().st_size >> 20} MiB in {time.perf_counter() - began:.0f} s",
        file=sys.stderr,
    )
