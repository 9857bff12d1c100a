"""dflash::BlockDenoise — single-pass block attention with KV injection.

Queries come from the B block slots only. Keys/values are the draft-context rows of the committed
positions (position-indexed cache, rows at or beyond `ctx_len` are stale and invisible) followed by the
block's own K/V. Full-attention drafter layers see all context and the whole block (bidirectional, no mask);
sliding-attention layers are causal inside the block and left-windowed, as z-lab's `_attention_mask`:
visible iff key <= query (causal) and query - key < window (and, if not causal, key - query < window).
"""

from __future__ import annotations

import torch
from dflash_trt.builder.layers import masked_attention
from dflash_trt.plugins.onnx_domain import DFLASH, op
from onnxscript import script

NEG_INF = float("-inf")


def block_visibility(
    query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """query_positions: [B, S], key_positions: [B, T], key_valid: [B, T] -> visible: [B, S, T] bool."""
    q_pos = query_positions[:, :, None]
    k_pos = key_positions[:, None, :]
    visible = key_valid[:, None, :].expand(-1, query_positions.shape[1], -1)
    if causal:
        visible = visible & (k_pos <= q_pos)
    if window is not None:
        visible = visible & (q_pos - k_pos < window)
        if not causal:
            visible = visible & (k_pos - q_pos < window)
    return visible


def block_denoise(
    q: torch.Tensor,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_len: torch.Tensor,
    block_positions: torch.Tensor,
    causal: bool,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of block queries over [context ; block].

    q: [B, S, H, D] (normed, rotated); block_k, block_v: [B, S, Hkv, D]; ctx_k, ctx_v: [B, T, Hkv, D]
    (position-indexed: row t holds position t); ctx_len: [B] committed positions; block_positions: [B, S]
    -> [B, S, H*D]
    """
    if torch.compiler.is_exporting():
        return torch.onnx.ops.symbolic(
            "dflash::BlockDenoise",
            (q, block_k, block_v, ctx_k, ctx_v, ctx_len, block_positions),
            {"causal": int(causal), "window": window or 0, "scale": scale},
            dtype=q.dtype,
            shape=(q.shape[0], q.shape[1], q.shape[2] * q.shape[3]),
            version=1,
        )
    batch, ctx_slots = ctx_k.shape[0], ctx_k.shape[1]
    ctx_positions = torch.arange(ctx_slots, device=q.device).expand(batch, -1)  # [B, T]
    key_positions = torch.cat([ctx_positions, block_positions], dim=1)  # [B, T+S]
    key_valid = torch.cat([ctx_positions < ctx_len[:, None], torch.ones_like(block_positions, dtype=torch.bool)], dim=1)
    visible = block_visibility(block_positions, key_positions, key_valid, causal, window)
    keys = torch.cat([ctx_k, block_k], dim=1)
    values = torch.cat([ctx_v, block_v], dim=1)
    return masked_attention(q, keys, values, visible, scale)


@script(DFLASH, default_opset=op)
def BlockDenoise(q, block_k, block_v, ctx_k, ctx_v, ctx_len, block_positions, causal: int, window: int, scale: float):
    """ONNX body of dflash::BlockDenoise (same shapes as `block_denoise`; window 0 = unlimited)."""
    keys = op.Concat(ctx_k, block_k, axis=1)  # [B, T+S, Hkv, D]
    values = op.Concat(ctx_v, block_v, axis=1)
    batch = op.Shape(block_positions, start=0, end=1)  # [1]
    slots = op.Shape(ctx_k, start=1, end=2)  # [1]
    ctx_positions = op.Range(op.Constant(value_int=0), op.Squeeze(slots), op.Constant(value_int=1))  # [T]
    ctx_positions = op.Expand(op.Unsqueeze(ctx_positions, [0]), op.Concat(batch, slots, axis=0))  # [B, T]
    key_positions = op.Concat(ctx_positions, block_positions, axis=1)  # [B, T+S]
    key_valid = op.Concat(op.Less(ctx_positions, op.Unsqueeze(ctx_len, [1])), op.Equal(block_positions, block_positions), axis=1)
    q_pos = op.Unsqueeze(block_positions, [2])  # [B, S, 1]
    k_pos = op.Unsqueeze(key_positions, [1])  # [B, 1, T+S]
    is_causal = op.Cast(op.Constant(value_int=causal), to=9)  # BOOL
    win = op.Constant(value_int=window)
    has_window = op.Greater(win, op.Constant(value_int=0))
    causal_ok = op.Or(op.Not(is_causal), op.LessOrEqual(k_pos, q_pos))
    left_ok = op.Or(op.Not(has_window), op.Less(op.Sub(q_pos, k_pos), win))
    right_ok = op.Or(op.Or(op.Not(has_window), is_causal), op.Less(op.Sub(k_pos, q_pos), win))
    visible = op.And(op.And(op.And(op.Unsqueeze(key_valid, [1]), causal_ok), left_ok), right_ok)  # [B, S, T+S]
    heads = op.Shape(q, start=2, end=3)
    kv_heads = op.Shape(keys, start=2, end=3)
    groups = op.Div(heads, kv_heads)
    q_t = op.Transpose(q, perm=[0, 2, 1, 3])  # [B, H, S, D]
    k_t = op.Transpose(keys, perm=[0, 2, 1, 3])  # [B, Hkv, T+S, D]
    v_t = op.Transpose(values, perm=[0, 2, 1, 3])
    grouped = op.Concat(op.Shape(k_t, start=0, end=2), groups, op.Shape(k_t, start=2), axis=0)  # [B, Hkv, G, T+S, D]
    merged = op.Concat(op.Shape(k_t, start=0, end=1), heads, op.Shape(k_t, start=2), axis=0)  # [B, H, T+S, D]
    k_t = op.Reshape(op.Expand(op.Unsqueeze(k_t, [2]), grouped), merged)
    v_t = op.Reshape(op.Expand(op.Unsqueeze(v_t, [2]), grouped), merged)
    scores = op.Mul(op.MatMul(q_t, op.Transpose(k_t, perm=[0, 1, 3, 2])), op.CastLike(op.Constant(value_float=scale), q))
    scores = op.Where(op.Unsqueeze(visible, [1]), scores, op.CastLike(op.Constant(value_float=NEG_INF), q))
    out = op.Transpose(op.MatMul(op.Softmax(scores, axis=-1), v_t), perm=[0, 2, 1, 3])  # [B, S, H, D]
    return op.Reshape(out, op.Concat(op.Shape(out, start=0, end=2), op.Constant(value_ints=[-1]), axis=0))


ONNX_FUNCTIONS = (BlockDenoise,)
