"""dflash::GatedDeltaRule — the gated delta-rule recurrence of Gated DeltaNet layers, token by token, in fp32.

Per token t (state S [B, Hv, dk, dv]; q_t, k_t [B, Hv, dk]; v_t [B, Hv, dv]; g_t, beta_t [B, Hv]):
    S = S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S = S + k_t (x) delta;  o_t = S^T q_t
which is transformers' `torch_recurrent_gated_delta_rule` after its l2 norm and query scaling (done by the
caller). The same op serves prefill (the whole prompt), verify (a block) and the masked commit (the block again,
gates of uncommitted tokens set to the identity). The ONNX body is one Scan over the token axis, so one graph
takes any number of tokens; TensorRT maps the node to a plugin (not built yet).
"""

from __future__ import annotations

import onnx
import torch
from dflash_trt.plugins.onnx_domain import DOMAIN, DOMAIN_VERSION, ONNX_OPSET
from onnx import TensorProto, helper


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, S, Hv, dk]; v [B, S, Hv, dv]; g, beta [B, S, Hv]; state [B, Hv, dk, dv], all fp32
    -> (out [B, S, Hv, dv], state after the S tokens)."""
    if torch.compiler.is_exporting():
        out, final = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::GatedDeltaRule",
            (q, k, v, g, beta, state),
            {},
            dtypes=(torch.float32, torch.float32),
            shapes=((*q.shape[:3], v.shape[3]), tuple(state.shape)),
            version=DOMAIN_VERSION,
        )
        return out, final
    outputs = []
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        remembered = (state * k[:, t, :, :, None]).sum(dim=-2)  # [B, Hv, dv]: S^T k
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]  # k (x) delta
        outputs.append((state * q[:, t, :, :, None]).sum(dim=-2))  # S^T q
    return torch.stack(outputs, dim=1), state


def _token_step() -> onnx.GraphProto:
    """The Scan body: (S; q_t, k_t, v_t, g_t, beta_t) -> (S', o_t)."""
    floats = TensorProto.FLOAT
    nodes = [
        helper.make_node("Constant", [], ["axis2"], value_ints=[2]),
        helper.make_node("Constant", [], ["axis3"], value_ints=[3]),
        helper.make_node("Constant", [], ["axes23"], value_ints=[2, 3]),
        helper.make_node("Exp", ["g_t"], ["decay"]),
        helper.make_node("Unsqueeze", ["decay", "axes23"], ["decay4"]),  # [B, Hv, 1, 1]
        helper.make_node("Mul", ["state_in", "decay4"], ["decayed"]),
        helper.make_node("Unsqueeze", ["k_t", "axis3"], ["k4"]),  # [B, Hv, dk, 1]
        helper.make_node("Mul", ["decayed", "k4"], ["sk"]),
        helper.make_node("ReduceSum", ["sk", "axis2"], ["remembered"], keepdims=0),  # [B, Hv, dv]
        helper.make_node("Sub", ["v_t", "remembered"], ["error"]),
        helper.make_node("Unsqueeze", ["beta_t", "axis2"], ["beta3"]),  # [B, Hv, 1]
        helper.make_node("Mul", ["error", "beta3"], ["delta"]),
        helper.make_node("Unsqueeze", ["delta", "axis2"], ["delta4"]),  # [B, Hv, 1, dv]
        helper.make_node("Mul", ["k4", "delta4"], ["update"]),
        helper.make_node("Add", ["decayed", "update"], ["state_out"]),
        helper.make_node("Unsqueeze", ["q_t", "axis3"], ["q4"]),
        helper.make_node("Mul", ["state_out", "q4"], ["sq"]),
        helper.make_node("ReduceSum", ["sq", "axis2"], ["o_t"], keepdims=0),  # [B, Hv, dv]
    ]
    inputs = [helper.make_tensor_value_info(name, floats, None) for name in ("state_in", "q_t", "k_t", "v_t", "g_t", "beta_t")]
    outputs = [helper.make_tensor_value_info(name, floats, None) for name in ("state_out", "o_t")]
    return helper.make_graph(nodes, "gated_delta_rule_token", inputs, outputs)


def onnx_function() -> onnx.FunctionProto:
    """The ONNX body of dflash::GatedDeltaRule: token-major transposes around one Scan (which iterates over axis 0)."""
    nodes = [
        *(helper.make_node("Transpose", [name], [f"{name}_tm"], perm=[1, 0, 2, 3]) for name in ("q", "k", "v")),
        *(helper.make_node("Transpose", [name], [f"{name}_tm"], perm=[1, 0, 2]) for name in ("g", "beta")),
        helper.make_node(
            "Scan",
            ["state", "q_tm", "k_tm", "v_tm", "g_tm", "beta_tm"],
            ["final_state", "out_tm"],
            num_scan_inputs=5,
            body=_token_step(),
        ),
        helper.make_node("Transpose", ["out_tm"], ["out"], perm=[1, 0, 2, 3]),
    ]
    return helper.make_function(
        DOMAIN,
        "GatedDeltaRule",
        ["q", "k", "v", "g", "beta", "state"],
        ["out", "final_state"],
        nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
    )
