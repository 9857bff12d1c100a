"""The ONNX side of the dflash:: ops: one custom domain, model-local functions with standard-op bodies.

Each op file defines its function in this domain. During export a `dflash` node is emitted with
`torch.onnx.ops.symbolic`; `attach_functions` then adds the function bodies to the model, so ONNX Runtime
runs the node as its body, while a TensorRT build strips the bodies and maps the nodes to plugins.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnxscript import opset23
from onnxscript.values import OnnxFunction, Opset

DOMAIN = "dflash"
DOMAIN_VERSION = 1
ONNX_OPSET = 23  # the standard opset of exported graphs and of the function bodies
DFLASH = Opset(DOMAIN, DOMAIN_VERSION)
op = opset23


def attach_functions(model: onnx.ModelProto, functions: Sequence[OnnxFunction | onnx.FunctionProto]) -> onnx.ModelProto:
    """Add the bodies of the dflash functions (and the domain import) to the model, in place. A body is written
    in onnxscript, or built as a FunctionProto where onnxscript cannot say it (a Scan with its body graph)."""
    present = {f.name for f in model.functions if f.domain == DOMAIN}
    protos = (f if isinstance(f, onnx.FunctionProto) else f.to_function_proto() for f in functions)
    model.functions.extend(proto for proto in protos if proto.name not in present)
    if not any(entry.domain == DOMAIN for entry in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model
