"""dflash::GatedDeltaRule — the gated delta-rule recurrence of Gated DeltaNet layers, token by token, in fp32.

Per token t (state S [B, Hv, dk, dv]; q_t, k_t [B, Hv, dk]; v_t [B, Hv, dv]; g_t, beta_t [B, Hv]):
    S = S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S = S + k_t (x) delta;  o_t = S^T q_t
which is transformers' `torch_recurrent_gated_delta_rule` after its l2 norm and query scaling (done by the
caller). The same op serves prefill (the whole prompt), verify (a block) and the masked commit (the block again,
gates of uncommitted tokens set to the identity). The ONNX body is one Scan over the token axis, so one graph
takes any number of tokens. The Triton kernel (a program per sequence, value head and block of value columns:
the columns of S evolve independently) is what the TensorRT plugin compiles ahead of time.
"""

from __future__ import annotations

import onnx
import torch
import triton
import triton.language as tl
from dflash_trt.plugins.onnx_domain import DOMAIN, DOMAIN_VERSION, ONNX_OPSET
from dflash_trt.plugins.triton_launch import KernelSpec, element_pointer, launch
from onnx import TensorProto, helper

BLOCK_V = 32  # value columns per program: a [dk, BLOCK_V] fp32 slice of the state stays in registers


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


@triton.jit
def gated_delta_rule_kernel(
    q, k, v, g, beta, state,  # inputs (TensorRT AOT order): q, k [B, S, Hv, DK]; v [B, S, Hv, DV]; g, beta [B, S, Hv]
    # and state [B, Hv, DK, DV] fp32
    length,  # S, the only runtime size besides the grid
    out, final_state,  # outputs: [B, S, Hv, DV] fp32, [B, Hv, DK, DV] fp32
    HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, value head h, value columns j0..j0+BLOCK_V): the recurrence over the S tokens for these
    state columns, in fp32 registers (column j of S depends only on column j and the token's q, k, g, beta)."""
    b, h, column_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = column_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < KEY_DIM, offs_v < VALUE_DIM
    tile = ((b * HEADS + h) * KEY_DIM + offs_k[:, None]) * VALUE_DIM + offs_v[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(state + tile, mask=tile_ok, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    for t in range(0, length):
        row = (b * length + t) * HEADS + h
        q_t = tl.load(q + row * KEY_DIM + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        k_t = tl.load(k + row * KEY_DIM + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        v_t = tl.load(v + row * VALUE_DIM + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        s = s * tl.exp(tl.load(g + row).to(tl.float32))
        remembered = tl.sum(s * k_t[:, None], axis=0)  # [BLOCK_V]: S^T k
        delta = (v_t - remembered) * tl.load(beta + row).to(tl.float32)
        s = s + k_t[:, None] * delta[None, :]
        tl.store(out + row * VALUE_DIM + offs_v, tl.sum(s * q_t[:, None], axis=0), mask=v_ok)  # S^T q
    tl.store(final_state + tile, s, mask=tile_ok)


def kernel_constexprs(heads: int, key_dim: int, value_dim: int) -> dict[str, int]:
    return {
        "HEADS": heads, "KEY_DIM": key_dim, "VALUE_DIM": value_dim, "BLOCK_K": triton.next_power_of_2(key_dim),
        "BLOCK_V": min(BLOCK_V, triton.next_power_of_2(value_dim)),
    }  # fmt: skip


def aot_spec(heads: int, key_dim: int, value_dim: int, dtype: torch.dtype) -> KernelSpec:
    """The kernel for a GPU build: grid (batch, value heads, value column blocks); q, k, v in `dtype`."""
    element = element_pointer(dtype)
    signature = {
        "q": element, "k": element, "v": element, "g": "*fp32", "beta": "*fp32", "state": "*fp32", "length": "i32",
        "out": "*fp32", "final_state": "*fp32",
    }  # fmt: skip
    return KernelSpec(
        gated_delta_rule_kernel, signature, kernel_constexprs(heads, key_dim, value_dim), ("batch", "heads", "columns")
    )


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op through its Triton kernel; same arguments and results as `gated_delta_rule` (q, k, v may be bf16/fp16)."""
    batch, length, heads, key_dim = k.shape
    value_dim = v.shape[3]
    constexprs = kernel_constexprs(heads, key_dim, value_dim)
    out = torch.empty((batch, length, heads, value_dim), dtype=torch.float32, device=v.device)
    final = torch.empty_like(state, dtype=torch.float32)
    inputs = [t.contiguous() for t in (q, k, v, g.float(), beta.float(), state.float())]
    grid = (batch, heads, triton.cdiv(value_dim, constexprs["BLOCK_V"]))
    launch(gated_delta_rule_kernel, grid, *inputs, length, out, final, **constexprs)
    return out, final
