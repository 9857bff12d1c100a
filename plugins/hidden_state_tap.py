"""dflash::HiddenStateTap — target taps -> fused draft context -> per-layer context K/V.

Reference semantics (z-lab `dflash/model.py`): the taps of the committed positions (target decoder layer
outputs, concatenated on the feature axis) are fused once per committed token,
`ctx = hidden_norm(fc(taps))`, and every drafter layer projects the same ctx with its own K/V projections
(not through input_layernorm): `K = rope(k_norm(k_proj(ctx)))`, `V = v_proj(ctx)`. The result is written into
the position-indexed draft cache; rows of rejected positions are overwritten by a later step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dflash_trt.builder.layers import apply_rotary, rms_norm, rotary_cos_sin
from dflash_trt.plugins.onnx_domain import DFLASH, op
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
    """Emit one dflash::HiddenStateTap node (export only); per-layer weights are stacked on a leading axis."""
    if any(b is not None for b in (*weights.k_bias, *weights.v_bias)):
        raise ValueError(
            "dflash::HiddenStateTap has no K/V bias inputs; drafters with attention_bias=true cannot be exported yet"
        )
    layers, kv_width, head_dim = len(weights.k_proj), weights.k_proj[0].shape[0], weights.k_norm[0].shape[0]
    out_shape = (layers, taps.shape[0], taps.shape[1], kv_width // head_dim, head_dim)
    inputs = (
        taps,
        positions,
        weights.fc,
        weights.hidden_norm,
        torch.stack(weights.k_proj),
        torch.stack(weights.v_proj),
        torch.stack(weights.k_norm),
        weights.inv_freq,
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
    mean_square = op.ReduceMean(op.Mul(x32, x32), op.Constant(value_ints=[-1]), keepdims=1)
    normed = op.Mul(x32, op.Reciprocal(op.Sqrt(op.Add(mean_square, op.Constant(value_float=eps)))))
    return op.Mul(weight, op.CastLike(normed, x))


@script(DFLASH, default_opset=op)
def HiddenStateTap(taps, positions, fc, hidden_norm, k_proj, v_proj, k_norm, inv_freq, eps: float, rope_scaling: float):
    """ONNX body of dflash::HiddenStateTap.

    taps [B, T, n*E], positions [B, T], fc [E, n*E], hidden_norm [E], k_proj/v_proj [L, Hkv*D, E], k_norm [L, D],
    inv_freq [D/2] -> ctx_k, ctx_v [L, B, T, Hkv, D]
    """
    ctx = DFLASH.RMSNormLastAxis(op.MatMul(taps, op.Transpose(fc, perm=[1, 0])), hidden_norm, eps=eps)  # [B, T, E]
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
