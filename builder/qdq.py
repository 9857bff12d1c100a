"""TensorRT's quantized forms as ONNX QuantizeLinear / DequantizeLinear (dflash-build --quantize fp8 | int4-awq).

TensorRT builds a strongly typed network from explicit Q/DQ nodes; its operator pages (Quantize, Dequantize) fix the
forms it parses: a build-time-constant scale that is a scalar (per tensor), 1-D (per channel) or, for INT4 only,
2-D (blocks); no zero point or an all-zero one; FP8 (E4M3), INT8 or INT4 data; INT4 for weights only, with a
dequantize between the stored weight and the matmul that reads it. `form_errors` checks a graph against those.

- `fp8`: each linear layer's weight in E4M3 with one scale per output channel (amax / 448), its input quantized to
  E4M3 per tensor with a scale calibrated on text (`calibration.py`: the largest |x| seen / 448); a Q/DQ pair per
  input tensor, shared by the layers that read it (q, k and v).
- `int4-awq`: weight-only INT4 in blocks of 128 along the input axis (64 or 32 where the input size needs it),
  with AWQ's per-input-channel scales: the weights of the layers sharing an input are multiplied by `s`, the input
  by `1 / s` (a Mul before them, which TensorRT fuses into the op producing the input), with `s = mean|x|^alpha`
  and alpha searched over a grid to minimise the layers' output error on the calibration rows (alpha 0 is plain
  round-to-nearest, so the search never does worse than it on those rows).
- Not quantized, in both modes: the LM head, embeddings, norms, the K/V states, and the drafter's taps (the
  HiddenStateTap op's own projections): the engine dtype.

ONNX Runtime runs these graphs too (it folds or fuses the weight dequantization), which is how their exactness and
quality are checked on a CPU; it is not a fast CPU mode (those are int8 and int4).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import onnx
import torch
from dflash_trt.builder.calibration import LinearInputs
from onnx import TensorProto, helper, numpy_helper

if TYPE_CHECKING:
    from dflash_trt.builder.quantize import QuantizationMode

FP8_MAX = 448.0  # E4M3's largest finite value
INT4_MAX = 7  # symmetric: [-8, 7] used as [-7, 7]
INT4_BLOCKS = (128, 64, 32)  # the largest that divides the layer's input size
AWQ_ALPHAS = tuple(step / 20 for step in range(20))
QDQ_OPSET = 21  # FP8 Q/DQ (19), INT4 and blocked DequantizeLinear (21)
QUANTIZED_TYPES = {TensorProto.FLOAT8E4M3FN, TensorProto.INT8, TensorProto.INT4}  # what TensorRT dequantizes


def fp8_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weight [K, N] -> (E4M3 [K, N], scale [N]): one scale per output channel."""
    scale = np.abs(weight).max(axis=0) / FP8_MAX  # [N]
    scale = np.where(scale > 0, scale, 1.0).astype(weight.dtype)
    return (weight / scale).astype(ml_dtypes.float8_e4m3fn), scale


def int4_block(inputs: int) -> int | None:
    return next((block for block in INT4_BLOCKS if inputs % block == 0), None)


def int4_weight(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [K, N] -> (integers in [-7, 7] as int8 [K, N], scale [K / block, N]): symmetric blocks along K."""
    inputs, outputs = weight.shape
    blocks = weight.reshape(inputs // block, block, outputs)  # [K/b, b, N]
    scale = blocks.abs().amax(dim=1) / INT4_MAX  # [K/b, N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(blocks / scale[:, None, :]), -INT4_MAX, INT4_MAX)
    return q.reshape(inputs, outputs).to(torch.int8), scale


def int4_dequantized(weight: torch.Tensor, block: int) -> torch.Tensor:
    q, scale = int4_weight(weight, block)
    return (q.float().reshape(-1, block, q.shape[1]) * scale[:, None, :]).reshape(q.shape)


def awq_scales(weights: list[torch.Tensor], inputs: LinearInputs, block: int) -> torch.Tensor:
    """AWQ for the layers reading one input: weights [K, N_i] -> s [K] minimising the mean squared error of
    (x / s) @ Q(s * W) against x @ W over the calibration rows, for s = mean|x|^alpha (normalised)."""
    x = inputs.rows_sample  # [r, K]
    weight = torch.cat(weights, dim=1).float()  # [K, sum N]: blocks are per column, so quantizing together is the same
    reference = x @ weight
    mean = inputs.mean_abs.clamp(min=1e-8)
    best, best_error = torch.ones_like(mean), float("inf")
    for alpha in AWQ_ALPHAS:
        s = mean.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
        error = float(((x / s) @ int4_dequantized(weight * s[:, None], block) - reference).pow(2).mean())
        if error < best_error:
            best, best_error = s, error
    return best


def quantize_qdq(
    model: onnx.ModelProto, layers: dict[str, QuantizationMode], calibration: dict[str, LinearInputs]
) -> onnx.ModelProto:
    """The MatMul nodes named in `layers` that apply a constant 2-D weight (held in the model) in their mode's Q/DQ
    form."""
    graph = QdqGraph(model)
    weights = {name for name, tensor in graph.initializers.items() if len(tensor.dims) == 2}
    nodes = {node.name: node for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in weights}
    left = []
    for name, quantize in (("fp8", quantize_fp8), ("int4-awq", quantize_int4_awq)):
        chosen = [nodes[node] for node in nodes if layers.get(node) is not None and layers[node].name == name]
        if chosen:
            left += quantize(graph, chosen, calibration)
            set_opset(model, QDQ_OPSET)
    if left:
        print(f"[dflash-build]   left in the engine dtype (no calibration or block fits): {', '.join(left)}", file=sys.stderr)
    return graph.finish()


def qdq_record(mode: str) -> dict[str, object]:
    """The manifest's account of a Q/DQ mode (this module's docstring, as data)."""
    shared = {"operator": "QuantizeLinear / DequantizeLinear", "lm_head": "engine dtype", "taps": "engine dtype"}
    if mode == "fp8":
        weights, activations = "FP8 E4M3, one scale per output channel", "FP8 E4M3, one calibrated scale per tensor"
    else:
        weights, activations = f"INT4, blocks of {'/'.join(map(str, INT4_BLOCKS))} along the input axis, AWQ", "engine dtype"
    return {**shared, "weights": weights, "activations": activations, "calibration": "the toolkit's Python sources"}


class QdqGraph:
    """One graph being rewritten: new initializers and the nodes to insert before a given node."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.initializers = {tensor.name: tensor for tensor in model.graph.initializer}
        self.before: dict[str, list[onnx.NodeProto]] = {}  # node name -> nodes to insert before it
        self.added: list[onnx.TensorProto] = []

    def constant(self, name: str, array: np.ndarray) -> str:
        self.added.append(numpy_helper.from_array(array, name))
        return name

    def insert(self, before: onnx.NodeProto, node: onnx.NodeProto) -> None:
        self.before.setdefault(before.name, []).append(node)

    def weight(self, node: onnx.NodeProto) -> np.ndarray:
        return numpy_helper.to_array(self.initializers[node.input[1]])

    def finish(self) -> onnx.ModelProto:
        """The rewritten graph: inserted nodes in place, unused float weights dropped."""
        graph = self.model.graph
        nodes = [n for node in graph.node for n in (*self.before.get(node.name, []), node)]
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(self.added)
        used = {name for node in graph.node for name in node.input}
        kept = [tensor for tensor in graph.initializer if tensor.name in used]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        return self.model


def quantize_fp8(graph: QdqGraph, layers: list[onnx.NodeProto], calibration: dict[str, LinearInputs]) -> list[str]:
    """E4M3 weights per output channel; each input tensor quantized per tensor once, before its first reader.
    Returns the layers left in the engine dtype (no calibration reached them, so their input has no scale)."""
    left = []
    for source, readers in by_input(layers).items():
        seen = [calibration.get(weight_parameter(node)) for node in readers]
        if any(inputs is None for inputs in seen):
            left += [weight_parameter(node) for node in readers]
            continue
        amax = max(inputs.amax for inputs in seen if inputs is not None)
        scale = graph.constant(f"{source}_fp8_scale", np.array(max(amax, 1e-8) / FP8_MAX, dtype=np.float32))
        zero = f"{source}_fp8_zero"
        graph.added.append(helper.make_tensor(zero, TensorProto.FLOAT8E4M3FN, [], [0.0]))
        quantized, restored = f"{source}_fp8", f"{source}_fp8_dq"
        graph.insert(readers[0], helper.make_node("QuantizeLinear", [source, scale, zero], [quantized], name=quantized))
        graph.insert(readers[0], helper.make_node("DequantizeLinear", [quantized, scale, zero], [restored], name=restored))
        for node in readers:
            q, weight_scale = fp8_weight(graph.weight(node))
            name = node.input[1]
            graph.constant(f"{name}_fp8", q)
            graph.constant(f"{name}_fp8_scale", weight_scale)
            dq = helper.make_node(
                "DequantizeLinear", [f"{name}_fp8", f"{name}_fp8_scale"], [f"{name}_fp8_dq"], name=f"{name}_fp8_dq", axis=1
            )
            graph.insert(node, dq)
            node.input[0], node.input[1] = restored, dq.output[0]
    return left


def quantize_int4_awq(graph: QdqGraph, layers: list[onnx.NodeProto], calibration: dict[str, LinearInputs]) -> list[str]:
    """INT4 blocks with AWQ scales per input; returns the layers left in the engine dtype (no block divides K)."""
    left = []
    for source, readers in by_input(layers).items():
        weights = [torch.from_numpy(graph.weight(node).copy()) for node in readers]
        block = int4_block(weights[0].shape[0])
        if block is None:
            left += [weight_parameter(node) for node in readers]
            continue
        inputs = calibration.get(weight_parameter(readers[0]))
        if inputs is None:
            s = torch.ones(weights[0].shape[0])
        else:  # the engine's four graphs hold the same layers: each group is searched once per build
            group = (tuple(weight_parameter(node) for node in readers), block)
            if group not in inputs.searched:
                inputs.searched[group] = awq_scales(weights, inputs, block)
            s = inputs.searched[group]
        dtype = weights[0].numpy().dtype
        inverse = graph.constant(f"{source}_awq_inverse_scale", (1.0 / s).numpy().astype(dtype))
        scaled = f"{source}_awq"
        graph.insert(readers[0], helper.make_node("Mul", [source, inverse], [scaled], name=scaled))
        for node, weight in zip(readers, weights, strict=True):
            q, scale = int4_weight(weight.float() * s[:, None], block)
            name = node.input[1]
            graph.constant(f"{name}_int4", q.numpy().astype(ml_dtypes.int4))
            graph.constant(f"{name}_int4_scale", scale.numpy().astype(dtype))
            dq = helper.make_node(
                "DequantizeLinear",
                [f"{name}_int4", f"{name}_int4_scale"],
                [f"{name}_int4_dq"],
                name=f"{name}_int4_dq",
                axis=0,
                block_size=block,
            )
            graph.insert(node, dq)
            node.input[0], node.input[1] = scaled, dq.output[0]
    return left


def by_input(layers: Iterable[onnx.NodeProto]) -> dict[str, list[onnx.NodeProto]]:
    """Layers grouped by the tensor they read, in graph order."""
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in layers:
        groups.setdefault(node.input[0], []).append(node)
    return groups


def weight_parameter(node: onnx.NodeProto) -> str:
    """The network parameter a MatMul applies, from the exporter's record of the traced call (`aten.linear(x, w)`)."""
    traced = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
    arguments = traced.split("args = (")[-1].split(")")[0].split(", ")
    if len(arguments) < 2 or not arguments[1].startswith("%p_"):
        raise ValueError(f"MatMul {node.name} does not record the parameter it applies ({traced[:80]!r})")
    return arguments[1][1:]


def set_opset(model: onnx.ModelProto, version: int) -> None:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, version)
    model.ir_version = max(model.ir_version, 10)  # INT4 tensors


def form_errors(model: onnx.ModelProto) -> list[str]:
    """Where the graph's Q/DQ nodes leave the forms TensorRT's Quantize and Dequantize pages document (empty: none)."""
    constants = {tensor.name: tensor for tensor in model.graph.initializer}
    types = {tensor.name: tensor.data_type for tensor in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    errors = []
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        scale = constants.get(node.input[1])
        zero = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is None:
            errors.append(f"{node.name}: the scale is not a build-time constant")
            continue
        if len(node.input) > 2 and node.input[2] and (zero is None or np.any(numpy_helper.to_array(zero).astype(np.float32))):
            errors.append(f"{node.name}: a zero point that is not all zeros")
        data = zero.data_type if zero is not None else types.get(node.input[0], TensorProto.UNDEFINED)
        if node.op_type == "DequantizeLinear" and data not in QUANTIZED_TYPES:
            errors.append(f"{node.name}: dequantizes {TensorProto.DataType.Name(data)}, not FP8 E4M3, INT8 or INT4")
        if node.op_type == "QuantizeLinear" and data not in (TensorProto.FLOAT8E4M3FN, TensorProto.INT8):
            errors.append(f"{node.name}: quantizes activations to {TensorProto.DataType.Name(data)} (INT4 is weight-only)")
        rank = len(scale.dims)
        if rank == 2 and data != TensorProto.INT4 or rank > 2:
            errors.append(f"{node.name}: a {rank}-D scale (blocks are for INT4 only)")
        if node.op_type == "DequantizeLinear" and node.input[0] in constants:
            linear = {reader.op_type for reader in readers.get(node.output[0], [])}
            if not linear or linear - {"MatMul", "Gemm", "Conv"}:
                errors.append(f"{node.name}: a dequantized weight read by {sorted(linear)}, not a linear operator")
    return errors
