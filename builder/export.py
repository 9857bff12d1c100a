"""ONNX export of the fused graphs, with the dflash:: ops as custom-domain nodes carrying model-local functions.

The three graphs share every weight: tensors are stored once, content-addressed, in `weights.bin` beside the
graphs, and each graph's initializers point into it (ONNX external data).
"""

from __future__ import annotations

import hashlib
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import torch
from dflash_trt.builder.graphs import GRAPHS, DFlashGraphs, graph_module, graph_outputs
from dflash_trt.plugins import block_denoise, hidden_state_tap
from dflash_trt.plugins.onnx_domain import ONNX_OPSET, attach_functions
from torch.export import Dim

WEIGHTS_FILE = "weights.bin"
INLINE_BYTES = 1024  # smaller tensors stay inside the graph
ALIGNMENT = 4096


def example_inputs(graphs: DFlashGraphs, name: str) -> tuple[tuple[torch.Tensor, ...], tuple[dict[int, Dim], ...]]:
    """Example inputs (batch 2, prompt 7, cache 9 rows, 3 candidates) and their dynamic axes for one graph."""
    t, d = graphs.target.config, graphs.drafter.config
    dtype, size = graphs.target.embed_tokens.weight.dtype, graphs.block_size
    batch, prompt, rows, cands = Dim("batch", min=1, max=1024), Dim("prompt", min=2), Dim("rows", min=2), Dim("candidates", min=1)
    params = (torch.tensor([0.0, 0.7]), torch.tensor([0, 3]), torch.tensor([1.0, 0.9]), torch.zeros(3, dtype=torch.long))
    param_axes: tuple[dict[int, Dim], ...] = ({0: batch}, {0: batch}, {0: batch}, {0: cands})
    # Each cache input gets its own tensor: export treats one tensor passed twice as one aliased input.
    target_shape, draft_shape = (t.num_layers, 2, 9, t.num_kv_heads, t.head_dim), (d.num_layers, 2, 9, d.num_kv_heads, d.head_dim)
    past_k, past_v = torch.zeros(target_shape, dtype=dtype), torch.zeros(target_shape, dtype=dtype)
    past_ctx_k, past_ctx_v = torch.zeros(draft_shape, dtype=dtype), torch.zeros(draft_shape, dtype=dtype)
    past_axes = {1: batch, 2: rows}
    if name == "prefill":
        return (torch.ones(2, 7, dtype=torch.long), torch.rand(2, 1), *params), ({0: batch, 1: prompt}, {0: batch}, *param_axes)
    if name == "step":
        inputs = (torch.ones(2, size, dtype=torch.long), torch.tensor([7, 9]), torch.rand(2, size), *params)
        return (*inputs, past_k, past_v, past_ctx_k, past_ctx_v), (
            {0: batch},
            {0: batch},
            {0: batch},
            *param_axes,
            *[past_axes] * 4,
        )
    inputs = (torch.ones(2, dtype=torch.long), torch.tensor([7, 9]), torch.rand(2, 1), *params)
    return (*inputs, past_k, past_v), ({0: batch}, {0: batch}, {0: batch}, *param_axes, past_axes, past_axes)


def export_graph(graphs: DFlashGraphs, name: str) -> onnx.ModelProto:
    """Trace one fused graph to ONNX (opset 20 + the dflash domain) and attach the dflash function bodies."""
    inputs, axes = example_inputs(graphs, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation chatter
        program = torch.onnx.export(
            graph_module(graphs, name),
            inputs,
            dynamo=True,
            opset_version=ONNX_OPSET,
            dynamic_shapes=axes,
            output_names=list(graph_outputs(name)),
            verbose=False,
        )
    assert program is not None
    model = fold_weight_transposes(program.model_proto)
    return attach_functions(model, [*hidden_state_tap.ONNX_FUNCTIONS, *block_denoise.ONNX_FUNCTIONS])


def fold_weight_transposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace Transpose(initializer) by a transposed initializer, in place.

    The exporter's optimizer leaves large ones (the lm_head / tied embedding) to run at every call, which
    costs more memory traffic than the matmul itself on a CPU.
    """
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        source = initializers.get(node.input[0]) if node.op_type == "Transpose" else None
        if source is None:
            kept.append(node)
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        folded = onnx.numpy_helper.to_array(source).transpose(perm)
        model.graph.initializer.append(onnx.numpy_helper.from_array(folded.copy(), name=node.output[0]))
    del model.graph.node[:]
    model.graph.node.extend(kept)
    used = {name for node in all_nodes(model.graph) for name in node.input} | {o.name for o in model.graph.output}
    unused = [tensor for tensor in model.graph.initializer if tensor.name not in used]
    for tensor in unused:
        model.graph.initializer.remove(tensor)
    return model


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and, recursively, those of its `If` branches (which read outer-scope values)."""
    branches = [b for node in graph.node for a in node.attribute for b in ([a.g] if a.HasField("g") else a.graphs)]
    return [*graph.node, *(node for branch in branches for node in all_nodes(branch))]


def save_with_shared_weights(models: dict[str, onnx.ModelProto], directory: Path) -> None:
    """Write `{name}.onnx` for each model and one content-addressed WEIGHTS_FILE holding every large tensor once."""
    offsets: dict[str, tuple[int, int]] = {}
    with open(directory / WEIGHTS_FILE, "wb") as blob:
        for model in models.values():
            for tensor in model.graph.initializer:
                data = onnx.numpy_helper.to_array(tensor).tobytes()
                if len(data) < INLINE_BYTES:
                    continue
                digest = hashlib.sha256(data).hexdigest()
                if digest not in offsets:
                    blob.seek(-blob.tell() % ALIGNMENT, 1)
                    offsets[digest] = (blob.tell(), len(data))
                    blob.write(data)
                _point_to(tensor, *offsets[digest])
    for name, model in models.items():
        onnx.save(model, directory / f"{name}.onnx")


def _point_to(tensor: onnx.TensorProto, offset: int, length: int) -> None:
    """Replace a tensor's inline data by a reference to WEIGHTS_FILE[offset:offset+length]."""
    for field in ("raw_data", "float_data", "int64_data", "int32_data", "double_data"):
        tensor.ClearField(field)  # type: ignore[arg-type]
    del tensor.external_data[:]
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def export_engines_onnx(graphs: DFlashGraphs, directory: Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """Export prefill, step and decode into `directory` (which must exist); returns the graph paths."""
    say = log or (lambda message: print(message, file=sys.stderr))
    models = {}
    for name in GRAPHS:
        began = time.perf_counter()
        say(f"[dflash-build] exporting the {name} graph to ONNX ...")
        models[name] = export_graph(graphs, name)
        say(f"[dflash-build]   {name}: {len(models[name].graph.node)} nodes in {time.perf_counter() - began:.1f} s")
    save_with_shared_weights(models, directory)
    return [directory / f"{name}.onnx" for name in models]
