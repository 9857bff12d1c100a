"""Tracing the graphs at once: one forked worker process per graph, up to the cores this process may use.

Tracing is single-threaded Python (torch.export, then the ONNX translation and its rewrites), about a minute per
graph for the tests' tiny pair and about 2 minutes for SmolLM2-135M on a 2-core CPU (2026-12-05), and the four
graphs do not depend on each other. The workers are forked after the networks are loaded, so they trace the parent's own modules
without a copy of the weights (tracing reads shapes, not weight data; the pages stay shared), and each sends back
its graph without the networks' parameters: an initializer that is a parameter (or a parameter's transpose, see
`export.TransposedWeight`) travels as its address, shape and dtype, which name the same tensor in the parent, and
the parent puts its own tensor back. Everything else (the small constants the exporter made) travels in the graph.
A worker dies with the build (PR_SET_PDEATHSIG), so a killed build leaves no tracer running.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from dflash_trt.builder.calibration import LinearInputs
from dflash_trt.builder.export import TransposedWeight, export_graph, write_engines
from dflash_trt.builder.graphs import DFlashGraphs
from dflash_trt.builder.quantize import MODES, QuantizationMode
from dflash_trt.runtime.engine import EngineSpec
from dflash_trt.runtime.graph_io import GRAPH_NAMES
from onnx_ir.tensor_adapters import TorchTensor

ParameterKey = tuple[int, tuple[int, ...], str]  # (address, shape, dtype): one tensor of the networks
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ParameterRef:
    """An initializer that is a parameter of the networks, or its transpose (`perm`)."""

    key: ParameterKey
    perm: tuple[int, ...] | None


def parameter_key(tensor: torch.Tensor) -> ParameterKey:
    return tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype)


def parameters_by_key(graphs: DFlashGraphs) -> dict[ParameterKey, torch.Tensor]:
    return {parameter_key(t): t for t in graphs.state_dict(keep_vars=True).values()}


def detach_parameters(model: ir.Model, parameters: dict[ParameterKey, torch.Tensor]) -> dict[str, ParameterRef]:
    """Replace each initializer that is (the transpose of) one of `parameters` by a placeholder without data, in
    place; returns what each placeholder stands for."""
    refs = {}
    for name, value in model.graph.initializers.items():
        original = value.const_value
        source, perm = (original.weight, original.perm) if isinstance(original, TransposedWeight) else (original, None)
        raw = getattr(source, "raw", None)
        if original is None or not isinstance(raw, torch.Tensor) or parameter_key(raw) not in parameters:
            continue
        refs[name] = ParameterRef(parameter_key(raw), perm)
        shape = ir.Shape(original.shape.numpy())
        value.const_value = ir.ExternalTensor("parameters", 0, 0, original.dtype, shape=shape, name=name)  # no data
    return refs


def attach_parameters(model: ir.Model, refs: dict[str, ParameterRef], parameters: dict[ParameterKey, torch.Tensor]) -> ir.Model:
    """Put the parent's tensors back where `detach_parameters` left placeholders (no copy: written when saved)."""
    for name, ref in refs.items():
        weight = TorchTensor(parameters[ref.key], name=name)
        model.graph.initializers[name].const_value = weight if ref.perm is None else TransposedWeight(weight, ref.perm, name)
    return model


# what forked workers trace, the networks' tensors by key, and where the workers write
_TRACING: tuple[DFlashGraphs, EngineSpec, dict[ParameterKey, torch.Tensor], Path] | None = None


def _start_worker() -> None:
    """A worker dies with the build and leaves the cores to tracing (one thread each)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    torch.set_num_threads(1)


@contextmanager
def _forking() -> Iterator[None]:
    """Around the forks: the parent's garbage dies in the parent, and what a worker inherits is frozen out of its
    collector. A worker that collected an unreachable ONNX Runtime session of the parent's (an earlier build or
    test in the same process) would tear down its thread pool, whose threads it does not have, and wait forever
    in pthread_cond_destroy (seen in a test run: two workers hung that way while importing sympy)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _trace(name: str) -> tuple[Path, dict[str, ParameterRef]]:
    """In a worker: trace graph `name`, write it without its parameters."""
    assert _TRACING is not None, "workers are forked from traced_in_parallel"
    graphs, spec, parameters, scratch = _TRACING
    began = time.perf_counter()
    _report(f"[dflash-build] exporting the {name} graph to ONNX ...")
    model = export_graph(graphs, spec, name)
    refs = detach_parameters(model, parameters)
    path = scratch / f"{name}.onnx"
    path.write_bytes(ir.serde.serialize_model(model).SerializeToString())
    seconds = time.perf_counter() - began
    _report(f"[dflash-build]   {name}: {len(model.graph)} nodes in {seconds:.1f} s")
    return path, refs


def _report(line: str) -> None:
    """One progress line from a worker, in one write: `print` writes the text and its newline apart, so two workers'
    lines could run together ("... ONNX ...[dflash-build] exporting ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextmanager
def traced_in_parallel(graphs: DFlashGraphs, spec: EngineSpec, scratch_parent: Path) -> Iterator[Callable[[str], ir.Model]]:
    """Start tracing every graph of GRAPH_NAMES in worker processes; yield `graph(name)`, which waits for that
    graph and returns it with the parent's parameters in place."""
    global _TRACING
    workers = max(1, min(len(GRAPH_NAMES), len(os.sched_getaffinity(0))))
    scratch = Path(tempfile.mkdtemp(prefix=".traced-", dir=scratch_parent))
    parameters = parameters_by_key(graphs)
    _TRACING = (graphs, spec, parameters, scratch)
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("fork"), initializer=_start_worker)
    try:
        with _forking():  # the workers are forked as the graphs are submitted
            futures: dict[str, Future[tuple[Path, dict[str, ParameterRef]]]] = {n: pool.submit(_trace, n) for n in GRAPH_NAMES}

        def graph(name: str) -> ir.Model:
            path, refs = futures[name].result()
            model = ir.serde.deserialize_model(onnx.load(str(path), load_external_data=False))
            return attach_parameters(model, refs, parameters)

        yield graph
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _TRACING = None
        shutil.rmtree(scratch, ignore_errors=True)


def export_engines_onnx(
    graphs: DFlashGraphs,
    spec: EngineSpec,
    directory: Path,
    quantization: QuantizationMode = MODES["none"],
    drafter_quantization: QuantizationMode | None = None,
    calibration: dict[str, LinearInputs] | None = None,
    draft_vocab: int = 0,
) -> list[Path]:
    """Export every graph of GRAPH_NAMES into `directory` (which must exist), traced in parallel, the target's
    linear layers quantized as `quantization` says and the drafter's as `drafter_quantization` (default: the
    same; Q/DQ modes set from `calibration`), the drafter's LM head cut to `draft_vocab` ids (0: whole); returns
    the graph paths."""
    with traced_in_parallel(graphs, spec, directory) as traced:
        return write_engines(traced, directory, quantization, drafter_quantization, calibration, draft_vocab)
