"""ONNX export of the fused graphs, with the dflash:: ops as custom-domain nodes carrying model-local functions.

The graphs share every weight: tensors are stored once, content-addressed, in `weights.bin` beside the graphs, and
each graph's initializers point into it (ONNX external data). Each graph's weights are written as soon as it is
traced, straight from the network's tensors: the build holds the network's weights once, not a copy per graph.
The graphs are traced in parallel worker processes (parallel_export.py); writing them out happens here.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer
import onnxscript.rewriter
import torch
from dflash_trt.builder.calibration import LinearInputs
from dflash_trt.builder.draft_vocab import DRAFTING_GRAPHS, cut_draft_head
from dflash_trt.builder.graphs import DFlashGraphs, graph_module
from dflash_trt.builder.quantize import MODES, QuantizationMode, quantize_graph
from dflash_trt.plugins import block_denoise, causal_conv1d, gated_delta_rule, hidden_state_tap
from dflash_trt.plugins.onnx_domain import ONNX_OPSET, attach_functions
from dflash_trt.runtime.engine import EngineSpec
from dflash_trt.runtime.graph_io import GRAPH_NAMES, POOL_AXIS, graph_inputs, graph_outputs, owner, pool_view_shape
from torch.export import Dim

WEIGHTS_FILE = "weights.bin"
INLINE_BYTES = 1024  # smaller tensors stay inside the graph
ALIGNMENT = 4096


# Example sizes for tracing: all different from each other (and from 0 and 1), so that no two axes get unified.
EXAMPLE_SIZES = {"batch": 3, "verify": 5, "sampled": 2, "candidates": 4, "rows": 9, "prompt": 7}
EXAMPLE_SLOTS = 2  # pool slots of the example states (their positions axis is the engine's own)
AXIS_RANGES = {"batch": (1, 1024), "verify": (1, 64), "sampled": (0, 1024), "rows": (1, None),
               "prompt": (1, None)}  # fmt: skip


def example_inputs(spec: EngineSpec, name: str) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, Dim], ...]]:
    """Example inputs for one graph, built from its schema, and their dynamic axes."""
    pools = {f"{owner(s)}_{POOL_AXIS[s.kind]}": (2, None) for s in spec.states}  # one size per owner's layer count
    # top-k candidates are at most the vocabulary: left unbounded, torch.export finds that bound and raises, and the
    # ONNX exporter traces the graph a second time with it (a third of an export)
    ranges = {**AXIS_RANGES, **pools, "drafts": (1, spec.block_size - 1), "candidates": (1, spec.vocab_size)}
    sizes = {**EXAMPLE_SIZES, "drafts": max(2, spec.block_size - 2)}
    dims = {axis: Dim(axis, min=low, max=high) if high else Dim(axis, min=low) for axis, (low, high) in ranges.items()}
    values = {
        "start": torch.tensor([7, 9, 4]),
        "slots": torch.tensor([1, 0, 1]),
        "sampled_rows": torch.tensor([2, 0]),
        "temperature": torch.tensor([0.7, 0.0, 1.0]),
        "top_k": torch.tensor([0, 3, 0]),
        "top_p": torch.tensor([0.9, 1.0, 1.0]),
    }
    inputs, axes = [], []
    for tensor in graph_inputs(name, spec.states):
        if tensor.dtype == "state":
            state = next(s for s in spec.states if s.name == tensor.name)
            rows = state.layers * EXAMPLE_SLOTS * (state.shape[0] if state.kind == "positional" else 1)
            pool = (rows, *pool_view_shape(state))  # flat: the engine binds a view
            inputs.append(torch.zeros(pool, dtype=state.torch_dtype))
            axes.append({0: dims[tensor.axes[0]]})
            continue
        shape = tuple(int(a) if a.isdigit() else sizes[a] for a in tensor.axes)
        if tensor.name in values:
            inputs.append(values[tensor.name])
        elif tensor.dtype == "float32":
            inputs.append(torch.rand(shape))
        else:
            inputs.append(torch.ones(shape, dtype=torch.long))
        axes.append({i: dims[a] for i, a in enumerate(tensor.axes) if not a.isdigit()})
    return tuple(inputs), tuple(axes)


ONNX_FUNCTIONS = [
    *hidden_state_tap.ONNX_FUNCTIONS, *block_denoise.ONNX_FUNCTIONS, *causal_conv1d.ONNX_FUNCTIONS,
    gated_delta_rule.onnx_function(),
]  # fmt: skip


def export_graph(graphs: DFlashGraphs, spec: EngineSpec, name: str) -> ir.Model:
    """Trace one fused graph to ONNX (opset 23 + the dflash domain). The returned model's initializers are the
    network's own tensors (no copy until they are written out)."""
    inputs, axes = example_inputs(spec, name)
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # its registry's "torchvision is not installed" lines
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation chatter
            program = torch.onnx.export(
                graph_module(graphs, name),
                inputs,
                dynamo=True,
                opset_version=ONNX_OPSET,
                dynamic_shapes=axes,
                input_names=[t.name for t in graph_inputs(name, spec.states)],
                output_names=[t.name for t in graph_outputs(name, spec.states)],
                optimize=False,  # its optimizer would fold every weight's Transpose into a copy: folded lazily first
                verbose=False,
            )
        assert program is not None
        fold_weight_transposes(program.model)
        with single_output_rewrites():
            # The exporter's `optimize()` would also apply onnxscript's opset-23 fusions (RMSNormalization,
            # RotaryEmbedding, GroupQueryAttention patterns): ops TensorRT's parser does not document. Only the
            # optimizer runs; attention is already one standard `Attention` node (layers.masked_attention).
            onnxscript.optimizer.optimize_ir(program.model)
    finally:
        exporter_log.setLevel(level)
    return program.model


@contextmanager
def single_output_rewrites() -> Iterator[None]:
    """The exporter's optimizer (onnxscript 0.7.2) without the rewrite rules whose pattern ends in several nodes.

    onnxscript matches such a pattern by trying every node of the graph as its other ends, per node: quadratic in
    the graph's size. Its one default rule of that kind (SlicesSplit: two Slices of the same tensor -> Split) never
    applies to these graphs (their second Slice ends at INT64_MAX, not at the last dimension) and took half of an
    export: SmolLM2-135M's decode graph 207 s with it, 99 s without, the same bytes; at 27B layer counts it grows
    with the square. Measured on the tiny qwen3 and qwen3_5 pairs' four graphs: the same bytes with and without."""
    default = onnxscript.rewriter._DEFAULT_REWRITE_RULES
    onnxscript.rewriter._DEFAULT_REWRITE_RULES = tuple(
        rule
        for rule in default
        if rule._target_pattern.has_single_output_node  # type: ignore[attr-defined]
    )
    try:
        yield
    finally:
        onnxscript.rewriter._DEFAULT_REWRITE_RULES = default


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a ModelProto with the dflash function bodies attached (initializers as the model holds them:
    in memory, or references into WEIGHTS_FILE once `SharedWeights.externalize` ran)."""
    return attach_functions(ir.serde.serialize_model(model), ONNX_FUNCTIONS)


def fold_weight_transposes(model: ir.Model) -> None:
    """Replace Transpose(initializer) by an initializer holding the transposed weight, in place, computed only when
    it is written out (one weight at a time: a linear layer's weight enters the graph through a Transpose, so folding
    them all at once would hold a second copy of the model).

    Left in the graph, such a Transpose runs at every call, which on a CPU costs more memory traffic than the matmul.
    """
    graph = model.graph
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Transpose" else None
        if source is None or source.const_value is None or not source.is_initializer():
            continue
        weight = source.const_value
        perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else list(range(len(weight.shape)))[::-1]
        output = node.outputs[0]
        folded = ir.Value(name=f"{output.name}_folded", type=output.type, shape=output.shape)
        folded.const_value = TransposedWeight(weight, perm, folded.name)
        ir.convenience.replace_all_uses_with(output, folded)
        graph.remove(node, safe=True)
        graph.register_initializer(folded)
        if not source.uses() and not source.is_graph_output():
            del graph.initializers[source.name]  # type: ignore[arg-type]


class TransposedWeight(ir.LazyTensor):
    """`weight` transposed by `perm`, computed when it is written out."""

    __slots__ = ("weight", "perm")

    def __init__(self, weight: ir.TensorProtocol, perm: Sequence[int], name: str | None) -> None:
        self.weight, self.perm = weight, tuple(perm)
        shape = ir.Shape([weight.shape.numpy()[axis] for axis in self.perm])
        super().__init__(partial(_transposed, weight, self.perm), weight.dtype, shape, name=name)


def _transposed(weight: ir.TensorProtocol, perm: Sequence[int]) -> ir.TensorProtocol:
    return ir.tensor(np.ascontiguousarray(weight.numpy().transpose(perm)))


class SharedWeights:
    """WEIGHTS_FILE, written while the graphs are exported: every large tensor once (content-addressed, aligned),
    one tensor in memory at a time."""

    def __init__(self, blob: BinaryIO, directory: Path) -> None:
        self.blob, self.directory = blob, directory
        self.offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)

    def place(self, data: bytes) -> tuple[int, int]:
        digest = hashlib.sha256(data).hexdigest()
        if digest not in self.offsets:
            self.blob.seek(-self.blob.tell() % ALIGNMENT, 1)
            self.offsets[digest] = (self.blob.tell(), len(data))
            self.blob.write(data)
        return self.offsets[digest]

    def externalize(self, model: ir.Model) -> None:
        """Write each initializer of INLINE_BYTES or more to the file; the model keeps a reference in its place."""
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < INLINE_BYTES:
                continue
            offset, length = self.place(tensor.tobytes())
            value.const_value = ir.ExternalTensor(
                WEIGHTS_FILE,
                offset,
                length,
                tensor.dtype,
                shape=ir.Shape(tensor.shape.numpy()),
                name=name,
                base_dir=self.directory,
            )


def package_exported(
    source: Path,
    directory: Path,
    quantization: QuantizationMode = MODES["none"],
    drafter_quantization: QuantizationMode | None = None,
    calibration: dict[str, LinearInputs] | None = None,
    draft_vocab: int = 0,
) -> list[Path]:
    """The float graphs an earlier export wrote into `source` (the export cache), quantized (and their draft head
    cut) as asked and written into `directory` with their own weights.bin, as `export_engines_onnx` would have
    written them. Float graphs are copied: the same bytes an export writes (not hard links: onnx refuses external
    data with several)."""
    if quantizes(quantization, drafter_quantization) or draft_vocab:
        graph = lambda name: ir.load(source / f"{name}.onnx")  # noqa: E731
        return write_engines(graph, directory, quantization, drafter_quantization, calibration, draft_vocab)
    for name in (*[f"{graph}.onnx" for graph in GRAPH_NAMES], WEIGHTS_FILE):
        shutil.copyfile(source / name, directory / name)
    return [directory / f"{name}.onnx" for name in GRAPH_NAMES]


def write_engines(
    graph: Callable[[str], ir.Model],
    directory: Path,
    quantization: QuantizationMode,
    drafter_quantization: QuantizationMode | None,
    calibration: dict[str, LinearInputs] | None = None,
    draft_vocab: int = 0,
) -> list[Path]:
    """Each graph of GRAPH_NAMES as `graph(name)` gives it, its draft head cut to `draft_vocab` ids (0: the whole
    vocabulary), quantized (Q/DQ modes: from `calibration`), its weights placed in WEIGHTS_FILE."""
    drafter_mode = drafter_quantization or quantization
    paths = []
    with open(directory / WEIGHTS_FILE, "wb") as blob:
        weights = SharedWeights(blob, directory)
        for name in GRAPH_NAMES:
            model = graph(name)
            if draft_vocab and name in DRAFTING_GRAPHS:
                cut_draft_head(model, draft_vocab, name)
            if quantizes(quantization, drafter_mode):
                began = time.perf_counter()
                model = ir.serde.deserialize_model(quantize_graph(with_weights(model), quantization, drafter_mode, calibration))
                modes = quantization.name if drafter_mode == quantization else f"{quantization.name}, drafter {drafter_mode.name}"
                seconds = time.perf_counter() - began
                print(f"[dflash-build]   {name}: linear layers quantized ({modes}) in {seconds:.1f} s", file=sys.stderr)
            weights.externalize(model)
            paths.append(directory / f"{name}.onnx")
            onnx.save(to_proto(model), paths[-1])
    return paths


def quantizes(quantization: QuantizationMode, drafter_quantization: QuantizationMode | None) -> bool:
    """Whether either side's linear layers are quantized (the drafter's mode defaults to the target's)."""
    return bool((drafter_quantization or quantization).bits or quantization.bits)


def with_weights(model: ir.Model) -> onnx.ModelProto:
    """The model as a ModelProto whose initializers hold their data (read from WEIGHTS_FILE where the model was
    loaded from a written export): what the quantizer reads."""
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = ir.tensor(value.const_value.numpy(), name=value.name)
    return to_proto(model)
