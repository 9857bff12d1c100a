"""dflash::HiddenStateTap — target taps -> fused draft context -> per-layer context K/V.

Reference semantics (z-lab `dflash/model.py`): the taps of the committed positions (target decoder layer
outputs, concatenated on the feature axis) are fused once per committed token,
`ctx = hidden_norm(fc(taps))`, and every drafter layer projects the same ctx with its own K/V projections
(not through input_layernorm): `K = rope(k_norm(k_proj(ctx)))`, `V = v_proj(ctx)`. The result is written into
the position-indexed draft cache; rows of rejected positions are overwritten by a later step.

The `fc` matmul stays a plain MatMul in front of the node (an engine's GEMM does it best); the op itself takes
`fused = fc(taps)` and does everything per row and head: the hidden norm, all layers' K/V projections, k_norm
and RoPE, in one kernel (`hidden_state_tap_kernel`). RMSNorm is a per-row scale, so the kernel projects
`hidden_norm * fused` and scales each row by 1/rms(fused) afterwards: one pass over the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from dflash_trt.builder.layers import apply_rotary, rms_norm, rotary_cos_sin
from dflash_trt.plugins.onnx_domain import DFLASH, op
from dflash_trt.plugins.triton_launch import KernelSpec, element_pointer, launch, upcast_dots
from onnxscript import script


@dataclass(frozen=True)
class TapWeights:
    """Weights the op reads. Per drafter layer l: k_proj[l]: [Hkv*D, E], v_proj[l]: [Hkv*D, E], k_norm[l]: [D]."""

    fc: torch.Tensor  # [E, n_taps*E]
    hidden_norm: torch.Tensor  # [E]
    k_proj: list[torch.Tensor]
    k_bias: list[torch.Tensor | None]
    v_proj: list[torch.Tensor]
    v_bias: list[torch.Tensor | None]
    k_norm: list[torch.Tensor]
    inv_freq: torch.Tensor  # [D/2]
    rope_scaling: float
    eps: float


def hidden_state_tap(taps: torch.Tensor, positions: torch.Tensor, weights: TapWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """taps: [B, T, n_taps*E], positions: [B, T] -> (ctx_k, ctx_v): [L, B, T, Hkv, D] each."""
    if torch.compiler.is_exporting():
        return _hidden_state_tap_node(taps, positions, weights)
    ctx = rms_norm(F.linear(taps, weights.fc), weights.hidden_norm, weights.eps)  # [B, T, E]
    head_dim = weights.k_norm[0].shape[0]
    cos, sin = rotary_cos_sin(weights.inv_freq, weights.rope_scaling, positions, ctx.dtype)
    keys, values = [], []
    for k_w, k_b, v_w, v_b, k_norm in zip(
        weights.k_proj, weights.k_bias, weights.v_proj, weights.v_bias, weights.k_norm, strict=True
    ):
        k = F.linear(ctx, k_w, k_b).unflatten(-1, (-1, head_dim))  # [B, T, Hkv, D]
        keys.append(apply_rotary(rms_norm(k, k_norm, weights.eps), cos, sin))
        values.append(F.linear(ctx, v_w, v_b).unflatten(-1, (-1, head_dim)))
    return torch.stack(keys), torch.stack(values)


def _hidden_state_tap_node(taps: torch.Tensor, positions: torch.Tensor, weights: TapWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Emit fc as a MatMul and one dflash::HiddenStateTap node (export only); per-layer weights are stacked on a
    leading axis."""
    if any(b is not None for b in (*weights.k_bias, *weights.v_bias)):
        raise ValueError(
            "dflash::HiddenStateTap has no K/V bias inputs; drafters with attention_bias=true cannot be exported yet"
        )
    layers, kv_width, head_dim = len(weights.k_proj), weights.k_proj[0].shape[0], weights.k_norm[0].shape[0]
    out_shape = (layers, taps.shape[0], taps.shape[1], kv_width // head_dim, head_dim)
    inputs = (
        F.linear(taps, weights.fc),  # fused: [B, T, E]
        positions,
        weights.hidden_norm,
        torch.stack(weights.k_proj),
        torch.stack(weights.v_proj),
        torch.stack(weights.k_norm),
        weights.inv_freq.float(),  # RoPE frequencies stay fp32 whatever the weights are (the plugin declares FP32)
    )
    outputs = torch.onnx.ops.symbolic_multi_out(
        "dflash::HiddenStateTap",
        inputs,
        {"eps": weights.eps, "rope_scaling": weights.rope_scaling},
        dtypes=(taps.dtype, taps.dtype),
        shapes=(out_shape, out_shape),
        version=1,
    )
    return outputs[0], outputs[1]


@script(DFLASH, default_opset=op)
def RMSNormLastAxis(x, weight, eps: float):
    """fp32 RMSNorm over the last axis, cast back, times weight (Llama/Qwen convention)."""
    x32 = op.Cast(x, to=1)  # FLOAT
    mean_square = op.ReduceMean(op.Pow(x32, op.Constant(value_float=2.0)), op.Constant(value_ints=[-1]), keepdims=1)
    normed = op.Div(x32, op.Sqrt(op.Add(mean_square, op.Constant(value_float=eps))))  # layers.rms_normalize's form
    return op.Mul(weight, op.CastLike(normed, x))


@script(DFLASH, default_opset=op)
def HiddenStateTap(fused, positions, hidden_norm, k_proj, v_proj, k_norm, inv_freq, eps: float, rope_scaling: float):
    """ONNX body of dflash::HiddenStateTap.

    fused [B, T, E] (= fc(taps)), positions [B, T], hidden_norm [E], k_proj/v_proj [L, Hkv*D, E], k_norm [L, D],
    inv_freq [D/2] -> ctx_k, ctx_v [L, B, T, Hkv, D]
    """
    ctx = DFLASH.RMSNormLastAxis(fused, hidden_norm, eps=eps)  # [B, T, E]
    ctx = op.Unsqueeze(ctx, [0])  # [1, B, T, E]
    head_dim = op.Shape(k_norm, start=1, end=2)
    split_heads = op.Concat(op.Constant(value_ints=[0, 0, 0, -1]), head_dim, axis=0)
    k = op.Reshape(op.MatMul(ctx, op.Unsqueeze(op.Transpose(k_proj, perm=[0, 2, 1]), [1])), split_heads)  # [L, B, T, Hkv, D]
    v = op.Reshape(op.MatMul(ctx, op.Unsqueeze(op.Transpose(v_proj, perm=[0, 2, 1]), [1])), split_heads)
    k = DFLASH.RMSNormLastAxis(k, op.Unsqueeze(k_norm, [1, 2, 3]), eps=eps)
    freqs = op.Mul(op.Unsqueeze(op.Cast(positions, to=1), [2]), inv_freq)  # [B, T, D/2]
    angles = op.Concat(freqs, freqs, axis=-1)  # [B, T, D]
    scaling = op.Constant(value_float=rope_scaling)
    cos = op.Unsqueeze(op.CastLike(op.Mul(op.Cos(angles), scaling), k), [0, 3])  # [1, B, T, 1, D]
    sin = op.Unsqueeze(op.CastLike(op.Mul(op.Sin(angles), scaling), k), [0, 3])
    first, second = op.Split(k, axis=-1, num_outputs=2)
    rotated = op.Concat(op.Neg(second), first, axis=-1)
    return op.Add(op.Mul(k, cos), op.Mul(rotated, sin)), v


ONNX_FUNCTIONS = (RMSNormLastAxis, HiddenStateTap)

BLOCK_ROWS = 16  # tl.dot needs >= 16 rows
BLOCK_E = 32  # reduction chunk: 4 weight tiles [BLOCK_E, D/2] live at once


@triton.jit
def hidden_state_tap_kernel(
    fused, positions, hidden_norm, k_proj, v_proj, k_norm, inv_freq,  # inputs (TensorRT AOT order)
    rows,  # B*T, the only runtime size
    ctx_k, ctx_v,  # outputs [L, rows, Hkv, D]
    HIDDEN: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, EPS: tl.constexpr,
    ROPE_SCALING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program (row block, layer*Hkv + head): K and V of one drafter layer's KV head for BLOCK_T rows.

    fused [rows, E]; positions [rows] int64; hidden_norm [E]; k_proj/v_proj [L, Hkv*D, E]; k_norm [L, D];
    inv_freq [D/2]. The head's output columns are computed as two halves so RoPE pairs column i with i+D/2.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    row_block, layer_head = tl.program_id(0), tl.program_id(1)
    layer, head = layer_head // KV_HEADS, layer_head % KV_HEADS
    offs_t = row_block * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    row_ok = offs_t < rows
    offs_h = tl.arange(0, HALF)  # [D/2]
    weight_rows = layer * (KV_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_h  # [D/2]: first-half output columns
    acc_k1 = tl.zeros((BLOCK_T, HALF), tl.float32)
    acc_k2 = tl.zeros((BLOCK_T, HALF), tl.float32)
    acc_v1 = tl.zeros((BLOCK_T, HALF), tl.float32)
    acc_v2 = tl.zeros((BLOCK_T, HALF), tl.float32)
    square_sum = tl.zeros((BLOCK_T,), tl.float32)
    for e0 in range(0, HIDDEN, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)  # [BE]
        e_ok = offs_e < HIDDEN
        x = tl.load(fused + offs_t[:, None] * HIDDEN + offs_e[None, :], mask=row_ok[:, None] & e_ok[None, :], other=0.0)
        x32 = x.to(tl.float32)  # [T, BE]
        square_sum += tl.sum(x32 * x32, axis=1)
        scaled = x32 * tl.load(hidden_norm + offs_e, mask=e_ok, other=0.0).to(tl.float32)[None, :]  # hidden_norm * x
        w_offsets = weight_rows[None, :] * HIDDEN + offs_e[:, None]  # [BE, D/2]: weight rows transposed
        wk1 = tl.load(k_proj + w_offsets, mask=e_ok[:, None], other=0.0)
        wk2 = tl.load(k_proj + w_offsets + HALF * HIDDEN, mask=e_ok[:, None], other=0.0)
        wv1 = tl.load(v_proj + w_offsets, mask=e_ok[:, None], other=0.0)
        wv2 = tl.load(v_proj + w_offsets + HALF * HIDDEN, mask=e_ok[:, None], other=0.0)
        if UPCAST:
            acc_k1 += tl.dot(scaled, wk1.to(tl.float32), input_precision="ieee")
            acc_k2 += tl.dot(scaled, wk2.to(tl.float32), input_precision="ieee")
            acc_v1 += tl.dot(scaled, wv1.to(tl.float32), input_precision="ieee")
            acc_v2 += tl.dot(scaled, wv2.to(tl.float32), input_precision="ieee")
        else:
            a = scaled.to(wk1.dtype)
            acc_k1 += tl.dot(a, wk1)
            acc_k2 += tl.dot(a, wk2)
            acc_v1 += tl.dot(a, wv1)
            acc_v2 += tl.dot(a, wv2)
    inv_rms = (1.0 / tl.sqrt(square_sum / HIDDEN + EPS))[:, None]  # [T, 1]: the hidden norm's per-row scale
    k1, k2 = acc_k1 * inv_rms, acc_k2 * inv_rms
    v1, v2 = acc_v1 * inv_rms, acc_v2 * inv_rms
    k_inv_rms = (1.0 / tl.sqrt((tl.sum(k1 * k1, axis=1) + tl.sum(k2 * k2, axis=1)) / HEAD_DIM + EPS))[:, None]
    k1 = k1 * k_inv_rms * tl.load(k_norm + layer * HEAD_DIM + offs_h).to(tl.float32)[None, :]
    k2 = k2 * k_inv_rms * tl.load(k_norm + layer * HEAD_DIM + HALF + offs_h).to(tl.float32)[None, :]
    position = tl.load(positions + offs_t, mask=row_ok, other=0).to(tl.float32)  # [T]
    angle = position[:, None] * tl.load(inv_freq + offs_h).to(tl.float32)[None, :]  # [T, D/2]
    cos, sin = tl.cos(angle) * ROPE_SCALING, tl.sin(angle) * ROPE_SCALING
    out = layer * rows * (KV_HEADS * HEAD_DIM) + offs_t[:, None] * (KV_HEADS * HEAD_DIM) + head * HEAD_DIM + offs_h[None, :]
    store_ok = row_ok[:, None]
    tl.store(ctx_k + out, (k1 * cos - k2 * sin).to(ctx_k.dtype.element_ty), mask=store_ok)
    tl.store(ctx_k + out + HALF, (k2 * cos + k1 * sin).to(ctx_k.dtype.element_ty), mask=store_ok)
    tl.store(ctx_v + out, v1.to(ctx_v.dtype.element_ty), mask=store_ok)
    tl.store(ctx_v + out + HALF, v2.to(ctx_v.dtype.element_ty), mask=store_ok)


def kernel_constexprs(
    hidden: int, kv_heads: int, head_dim: int, eps: float, rope_scaling: float, upcast: bool
) -> dict[str, int | float | bool]:
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the HiddenStateTap kernel needs a power of two >= 32")
    return {
        "HIDDEN": hidden, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "EPS": eps, "ROPE_SCALING": rope_scaling,
        "BLOCK_T": BLOCK_ROWS, "BLOCK_E": BLOCK_E, "UPCAST": upcast,
    }  # fmt: skip


def aot_spec(hidden: int, kv_heads: int, head_dim: int, eps: float, rope_scaling: float, dtype: torch.dtype) -> KernelSpec:
    """The kernel for a GPU build: grid (cdiv(rows, BLOCK_ROWS), layers * kv_heads)."""
    element = element_pointer(dtype)
    signature = {
        "fused": element, "positions": "*i64", "hidden_norm": element, "k_proj": element, "v_proj": element,
        "k_norm": element, "inv_freq": "*fp32", "rows": "i32", "ctx_k": element, "ctx_v": element,
    }  # fmt: skip
    constexprs = kernel_constexprs(hidden, kv_heads, head_dim, eps, rope_scaling, upcast=False)
    return KernelSpec(hidden_state_tap_kernel, signature, constexprs, ("row blocks of 16", "layers x kv heads"))


def hidden_state_tap_triton(
    fused: torch.Tensor, positions: torch.Tensor, weights: TapWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op through its Triton kernel: fused [B, T, E] (= fc(taps)), positions [B, T] -> ctx_k, ctx_v [L, B, T, Hkv, D]."""
    batch, slots, hidden = fused.shape
    layers, head_dim = len(weights.k_proj), weights.k_norm[0].shape[0]
    kv_heads = weights.k_proj[0].shape[0] // head_dim
    constexprs = kernel_constexprs(hidden, kv_heads, head_dim, weights.eps, weights.rope_scaling, upcast_dots(fused))
    ctx_k = torch.empty((layers, batch, slots, kv_heads, head_dim), dtype=fused.dtype, device=fused.device)
    ctx_v = torch.empty_like(ctx_k)
    rows = batch * slots
    grid = (triton.cdiv(rows, BLOCK_ROWS), layers * kv_heads)
    inputs = (
        fused.contiguous(), positions.contiguous(), weights.hidden_norm, torch.stack(weights.k_proj), torch.stack(weights.v_proj),
        torch.stack(weights.k_norm), weights.inv_freq.float(),
    )  # fmt: skip
    launch(hidden_state_tap_kernel, grid, *inputs, rows, ctx_k, ctx_v, **constexprs)
    return ctx_k, ctx_v
