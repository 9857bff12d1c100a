"""dflash-build --quantize: weight-only quantization of the exported graphs' linear layers, with ONNX Runtime's own
operator (`com.microsoft.MatMulNBits`) and its own tooling (`MatMulNBitsQuantizer`), applied after export.

Policy (the same for the target's and the drafter's linear layers unless `--quantize-drafter` says otherwise):
- Linear layers (attention, MLP, the drafter's tap projection `fc`): `bits`-bit weights in blocks of BLOCK_SIZE
  along the input axis, one scale per block (in the engine dtype), symmetric (no zero points), round to nearest.
- The LM head: 8-bit in every mode (it decides every token; llama.cpp's 4-bit types keep their output layer at 6
  bits or more too).
- Embeddings stay in the engine's dtype (float32 on the CPU): a lookup reads one row per token, no arithmetic to save.
- Activations, the hidden-state taps the drafter is conditioned on, the K/V states and every norm stay in it too.
  The matmul kernel quantizes its input rows to int8 per block on the fly (accuracy level 4: int8 dot products,
  float32 accumulation of the block sums), row by row, so a token's result does not depend on the other rows of
  its call; with the target's keys in position order (networks.TargetAttention) DFlash leaves bitwise what plain
  decoding leaves on the same quantized engine. That needs ONNX Runtime's kernels to be row-independent, which
  `rows_independent` checks on the CPU at hand: 8 bits on every CPU seen here; 4 bits on AVX-512 VNNI (AMD EPYC
  Zen 4) for any number of rows, on AVX2 (Zen 3) from two rows up: its one-row 4-bit kernel rounds differently
  (~1e-6). Where `pad_single_rows` says so, the ONNX Runtime runner runs one-row calls as two identical rows.
- `--quantize-drafter MODE` quantizes the drafter's side of the graphs on its own (its layers, its tap projection
  `fc`, and its use of the LM head, which then gets a quantized copy of its own): drafts only propose tokens that
  the target verifies, so the drafter's precision changes acceptance, never output. Default: the target's mode.

TensorRT's modes (`fp8`, `int4-awq`) are QuantizeLinear / DequantizeLinear graphs calibrated on text: `qdq.py`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import onnx
from dflash_trt.builder.calibration import LinearInputs

BLOCK_SIZE = 32  # weights per scale along the input axis (llama.cpp's Q8_0 / Q4_0 blocks are 32 too)
ACCURACY_LEVEL = 4  # MatMulNBits: quantize the input rows to int8 and use int8 dot products
LM_HEAD_BITS = 8


@dataclass(frozen=True)
class QuantizationMode:
    name: str
    backends: tuple[str, ...]  # the backends that run its graphs (() = any)
    bits: int  # linear-layer weight bits (0 = not quantized)
    summary: str
    form: str = "matmulnbits"  # "matmulnbits" (ONNX Runtime's operator) | "qdq" (TensorRT's Q/DQ, qdq.py) | "none"


MODES = {
    mode.name: mode
    for mode in (
        QuantizationMode("none", (), 0, "float weights (the --dtype)", "none"),
        QuantizationMode("int8", ("onnxruntime",), 8, "8-bit block-wise weights (MatMulNBits), int8 dot products"),
        QuantizationMode("int4", ("onnxruntime",), 4, "4-bit block-wise weights (MatMulNBits), 8-bit LM head"),
        QuantizationMode(
            "fp8", ("tensorrt", "onnxruntime"), 8, "E4M3 weights per channel, E4M3 activations per tensor (Q/DQ)", "qdq"
        ),
        QuantizationMode(
            "int4-awq", ("tensorrt", "onnxruntime"), 4, "INT4 weights in blocks, AWQ scales, float activations (DQ)", "qdq"
        ),
    )
}


def check_mode(name: str, backend: str, option: str = "--quantize") -> QuantizationMode:
    """The mode, or a ValueError naming what runs where (and the `option` it came from)."""
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"{option} {name!r} is not a mode; choose one of {', '.join(MODES)}")
    if mode.backends and backend not in mode.backends:
        runs_here = ", ".join(m.name for m in MODES.values() if not m.backends or backend in m.backends)
        raise ValueError(
            f"{option} {name} builds {mode.backends[0]} operators, and this build's backend is {backend}: "
            f"pass --backend {mode.backends[0]}, or one of the {backend} modes ({runs_here})"
        )
    return mode


def manifest_record(mode: QuantizationMode, drafter_mode: QuantizationMode | None = None) -> dict[str, object]:
    """What the engine manifest says about the quantization (the policy of this module's docstring, as data); a
    drafter quantized on its own has a record of its own under "drafter"."""
    record = _mode_record(mode)
    if drafter_mode is not None and drafter_mode != mode:
        record["drafter"] = _mode_record(drafter_mode)
    return record


def _mode_record(mode: QuantizationMode) -> dict[str, object]:
    if mode.bits == 0:
        return {"mode": mode.name}
    if mode.form == "qdq":
        from dflash_trt.builder.qdq import qdq_record

        return {"mode": mode.name, "summary": mode.summary, "bits": mode.bits, **qdq_record(mode.name)}
    return {
        "mode": mode.name,
        "summary": mode.summary,
        "bits": mode.bits,
        "operator": "com.microsoft.MatMulNBits",
        "block_size": BLOCK_SIZE,
        "symmetric": True,
        "accuracy_level": ACCURACY_LEVEL,
        "lm_head_bits": LM_HEAD_BITS,
        "embeddings": "engine dtype",
        "activations_and_taps": "engine dtype",
    }


HEAD_PARAMETERS = ("lm_head_weight", "embed_tokens_weight")  # the LM head, or the embedding when tied


def reads_lm_head(fx_node: str) -> bool:
    """Whether a node's traced torch node (its `pkg.torch.onnx.fx_node` metadata) takes the LM head as an argument."""
    return fx_node.split("args = (")[-1].split(")")[0].endswith(HEAD_PARAMETERS)


def in_target_scope(name_scopes: str) -> bool:
    """Whether a node's module scopes (its `pkg.torch.onnx.name_scopes` metadata) lie in the target network."""
    return "'target'" in name_scopes


def lm_head_nodes(model: onnx.ModelProto) -> list[str]:
    """MatMul nodes applying the LM head (the target's, and the drafter's use of it): those whose weight is the
    `lm_head` parameter, or the embedding when tied, as the exporter recorded in each node's metadata, and every
    MatMul sharing that weight. (A weight's shape cannot tell: a projection may have as many outputs as the vocab.)"""
    traced = [node for node in model.graph.node if node.op_type == "MatMul" and reads_lm_head(_metadata(node, "fx_node"))]
    weights = {node.input[1] for node in traced}
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in weights]


def drafter_nodes(model: onnx.ModelProto) -> list[str]:
    """MatMul nodes with a constant weight on the drafter's side: everything outside the target network's module
    scope (the exporter records each node's scopes). Each must read a drafter parameter or the LM head, else this
    raises: a graph that computed target values outside the target's scope must not lose their precision."""
    constants = {tensor.name for tensor in model.graph.initializer}
    head = set(lm_head_nodes(model))
    found = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in constants or in_target_scope(_metadata(node, "name_scopes")):
            continue
        if node.name not in head and "p_drafter_" not in _metadata(node, "fx_node"):
            raise ValueError(f"MatMul {node.name} is outside the target's scope but reads no drafter weight")
        found.append(node.name)
    return found


def _metadata(node: onnx.NodeProto, key: str) -> str:
    return next((p.value for p in node.metadata_props if p.key == f"pkg.torch.onnx.{key}"), "")


def quantize_graph(
    model: onnx.ModelProto,
    mode: QuantizationMode,
    drafter_mode: QuantizationMode | None = None,
    calibration: dict[str, LinearInputs] | None = None,
) -> onnx.ModelProto:
    """Every MatMul with a constant 2-D weight -> MatMulNBits at its side's bits (the target's `mode`, the drafter's
    `drafter_mode`, default the same; an LM head at LM_HEAD_BITS when its side is quantized), or TensorRT's Q/DQ form
    for a side whose mode is one (`qdq.py`, set from `calibration`; LM heads stay in the engine dtype there).
    Deterministic, so the graphs of one engine still share each quantized weight in weights.bin."""
    drafter_mode = drafter_mode or mode
    head = set(lm_head_nodes(model))
    drafter = set(drafter_nodes(model)) if drafter_mode != mode else set()
    matmuls = [node.name for node in model.graph.node if node.op_type == "MatMul"]
    target = set(matmuls) - drafter
    sides = ((mode, target), (drafter_mode, drafter))
    groups = [  # (bits, the nodes quantized at those bits by MatMulNBits)
        (bits, nodes)
        for side_mode, side in sides
        if side_mode.form == "matmulnbits"
        for bits, nodes in ((side_mode.bits, side - head), (LM_HEAD_BITS, side & head))
    ]
    quantizer_class = _matmul_nbits_quantizer()
    quantizer_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.WARNING)  # one INFO line per node it leaves alone
    settings = {"block_size": BLOCK_SIZE, "is_symmetric": True, "accuracy_level": ACCURACY_LEVEL}
    try:
        for bits, nodes in groups:
            if bits and nodes:  # the quantizer takes every MatMul it is not told to leave alone
                exclude = [node.name for node in model.graph.node if node.op_type == "MatMul" and node.name not in nodes]
                quantizer = quantizer_class(model, bits=bits, nodes_to_exclude=exclude, **settings)
                quantizer.process()
                model = quantizer.model.model
    finally:
        quantizer_log.setLevel(level)
    qdq_layers = {name: side_mode for side_mode, side in sides if side_mode.form == "qdq" for name in side - head}
    if qdq_layers:
        from dflash_trt.builder.qdq import quantize_qdq

        model = quantize_qdq(model, qdq_layers, calibration or {})
    return model


@functools.cache
def rows_independent(mode: QuantizationMode, rows: int = 16, alone: int = 1) -> bool:
    """Whether ONNX Runtime's kernels for a linear layer quantized as `mode` (MatMulNBits at its bits, or its Q/DQ
    form as ONNX Runtime fuses it) give the first `alone` rows of a call of `rows` rows the same bits when they are
    the whole call, on this CPU (a 576 x 1536 random layer, the demo target's MLP shape)."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    generator = np.random.default_rng(0)
    inputs, outputs = 576, 1536
    weight = numpy_helper.from_array((generator.standard_normal((inputs, outputs)) * 0.05).astype(np.float32), "w")
    linear = helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")
    helper.set_metadata_props(linear, {"pkg.torch.onnx.fx_node": "aten.linear.default](args = (%x, %p_probe_weight))"})
    graph = helper.make_graph(
        [linear],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", inputs])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", outputs])],
        [weight],
    )
    x = generator.standard_normal((rows, inputs)).astype(np.float32)
    calibration = {"p_probe_weight": LinearInputs()}
    calibration["p_probe_weight"].add(torch.from_numpy(x))
    model = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), mode, calibration=calibration)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return bool(np.array_equal(session.run(None, {"x": x[:alone]})[0], session.run(None, {"x": x})[0][:alone]))


def pad_single_rows(mode: QuantizationMode) -> bool:
    """Whether a target quantized as `mode` needs its one-row calls run as two identical rows on this CPU: its
    kernels (or the 8-bit LM head's) give a lone row other bits than a row among others, and two rows already get
    the many-row bits (AVX2's one-row 4-bit kernel). Then a token's bits do not depend on its call's size."""
    if not mode.bits:
        return False
    kernels = {mode, MODES["int8"]} if mode.form == "matmulnbits" else {mode}  # the 8-bit LM head; Q/DQ: float head
    return any(not rows_independent(m) and rows_independent(m, alone=2) for m in kernels)


def _matmul_nbits_quantizer() -> Any:
    """ONNX Runtime's MatMulNBitsQuantizer class. Its module calls logging.basicConfig(level=INFO) when imported,
    which would turn on every library's INFO lines (the ONNX exporter's among them): the root logger is put back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:] = handlers
    root.setLevel(level)
    return MatMulNBitsQuantizer
