"""dflash::BlockDenoise — single-pass block attention with KV injection.

Queries come from the B block slots only. Keys/values are the draft-context rows of the committed
positions (position-indexed cache, rows at or beyond `ctx_len` are stale and invisible) followed by the
block's own K/V. Full-attention drafter layers see all context and the whole block (bidirectional, no mask);
sliding-attention layers are causal inside the block and left-windowed, as z-lab's `_attention_mask`:
visible iff key <= query (causal) and query - key < window (and, if not causal, key - query < window).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from dflash_trt.builder.layers import masked_attention
from dflash_trt.plugins.onnx_domain import DFLASH, op
from dflash_trt.plugins.triton_launch import KernelSpec, element_pointer, launch, upcast_dots
from onnxscript import script


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
    max_block: int | None = None,
) -> torch.Tensor:
    """Attention of block queries over [context ; block].

    q: [B, S, H, D] (normed, rotated); block_k, block_v: [B, S, Hkv, D]; ctx_k, ctx_v: [B, T, Hkv, D]
    (position-indexed: row t holds position t); ctx_len: [B] committed positions; block_positions: [B, S]
    -> [B, S, H*D]. S <= max_block, the drafter's block size (a step that uses k drafts denoises 1 + k slots; a
    compiled kernel is sized for max_block; None: S itself, a static size).
    """
    if torch.compiler.is_exporting():
        return torch.onnx.ops.symbolic(
            "dflash::BlockDenoise",
            (q, block_k, block_v, ctx_k, ctx_v, ctx_len, block_positions),
            {"causal": int(causal), "window": window or 0, "scale": scale, "max_block": max_block or int(q.shape[1])},
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
def BlockDenoise(
    q, block_k, block_v, ctx_k, ctx_v, ctx_len, block_positions, causal: int, window: int, scale: float, max_block: int
):
    """ONNX body of dflash::BlockDenoise (same shapes as `block_denoise`; window 0 = unlimited; max_block sizes the
    compiled kernels only)."""
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
    q_t = op.Transpose(q, perm=[0, 2, 1, 3])  # [B, H, S, D]
    k_t = op.Transpose(keys, perm=[0, 2, 1, 3])  # [B, Hkv, T+S, D]: Attention groups the query heads itself
    v_t = op.Transpose(values, perm=[0, 2, 1, 3])
    out = op.Attention(q_t, k_t, v_t, op.Unsqueeze(visible, [1]), scale=scale)  # [B, H, S, D]
    out = op.Transpose(out, perm=[0, 2, 1, 3])  # [B, S, H, D]
    return op.Reshape(out, op.Concat(op.Shape(out, start=0, end=2), op.Constant(value_ints=[-1]), axis=0))


ONNX_FUNCTIONS = (BlockDenoise,)

MIN_DOT = 16  # tl.dot needs >= 16 along every axis


@triton.jit
def block_denoise_kernel(
    q, block_k, block_v, ctx_k, ctx_v, ctx_len, block_positions,  # inputs (TensorRT AOT order)
    ctx_slots, block_len,  # T and S, the runtime sizes besides the grid
    out,  # output [B, S, H*D]
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, query head h): the S block queries over [valid context rows ; block rows].

    q [B, S, H, D]; block_k/v [B, S, Hkv, D]; ctx_k/v [B, T, Hkv, D]; ctx_len [B]; block_positions [B, S].
    One online-softmax loop walks the context in BLOCK_N chunks up to ctx_len (stale rows are never read;
    with a window, chunks left of it are skipped) and then one more chunk holding the block's own keys.
    """
    b, h = tl.program_id(0), tl.program_id(1)
    kv_head = h // (HEADS // KV_HEADS)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < block_len
    offs_d = tl.arange(0, HEAD_DIM)
    query = tl.load(
        q + ((b * block_len + offs_s[:, None]) * HEADS + h) * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )
    q_pos = tl.load(block_positions + b * block_len + offs_s, mask=s_ok, other=0)  # [S]
    valid_ctx = tl.minimum(tl.load(ctx_len + b), ctx_slots)
    ctx_end = tl.cdiv(valid_ctx, BLOCK_N) * BLOCK_N  # the block's keys occupy the chunk after the context
    first = 0
    if WINDOW > 0:  # skip chunks wholly left of every query's window
        lowest_query = tl.min(tl.where(s_ok, q_pos, 2**62), axis=0)
        first = tl.minimum(tl.maximum(lowest_query - WINDOW + 1, 0) // BLOCK_N * BLOCK_N, ctx_end)
    m_i = tl.full((BLOCK_S,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_S,), tl.float32)
    acc = tl.zeros((BLOCK_S, HEAD_DIM), tl.float32)
    for n0 in range(first, ctx_end + BLOCK_N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_ctx = offs_n < valid_ctx
        slot = offs_n - ctx_end  # index into the block for the final chunk
        in_block = (slot >= 0) & (slot < block_len)
        ctx_rows = ((b * ctx_slots + offs_n[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]
        block_rows = ((b * block_len + slot[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + offs_d[None, :]
        keys = tl.load(ctx_k + ctx_rows, mask=in_ctx[:, None], other=0.0) + tl.load(
            block_k + block_rows, mask=in_block[:, None], other=0.0
        )
        values = tl.load(ctx_v + ctx_rows, mask=in_ctx[:, None], other=0.0) + tl.load(
            block_v + block_rows, mask=in_block[:, None], other=0.0
        )
        k_pos = tl.where(in_block, tl.load(block_positions + b * block_len + slot, mask=in_block, other=0), offs_n)
        visible = (in_ctx | in_block)[None, :] & s_ok[:, None]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < WINDOW)
            if not CAUSAL:
                visible = visible & (k_pos[None, :] - q_pos[:, None] < WINDOW)
        if UPCAST:
            scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(query, tl.trans(keys))
        scores = tl.where(visible, scores * SCALE, float("-inf"))  # [S, N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        m_i = m_new
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i = 0 only on padding rows (S < BLOCK_S)
    destination = ((b * block_len + offs_s[:, None]) * HEADS + h) * HEAD_DIM + offs_d[None, :]
    tl.store(out + destination, result.to(out.dtype.element_ty), mask=s_ok[:, None])


def kernel_constexprs(
    max_block: int, heads: int, kv_heads: int, head_dim: int, causal: bool, window: int | None, scale: float, upcast: bool,
    block_n: int = 32,
) -> dict[str, int | float | bool]:  # fmt: skip
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the BlockDenoise kernel needs a power of two >= {MIN_DOT}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    block_s = max(MIN_DOT, triton.next_power_of_2(max_block))  # block rows per tile: every S <= max_block fits
    return {
        "HEADS": heads, "KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "CAUSAL": causal,
        "WINDOW": window or 0, "SCALE": scale, "BLOCK_S": block_s, "BLOCK_N": max(block_n, block_s), "UPCAST": upcast,
    }  # fmt: skip


TACTIC_BLOCK_N = {1: 32, 2: 64, 3: 128}  # TensorRT tactic -> context rows per chunk (long contexts like larger)


def aot_spec(
    max_block: int, heads: int, kv_heads: int, head_dim: int, causal: bool, window: int | None, scale: float,
    dtype: torch.dtype, block_n: int = 32,
) -> KernelSpec:  # fmt: skip
    """The kernel for a GPU build: grid (batch, heads); any block length up to max_block at run time."""
    element = element_pointer(dtype)
    signature = {
        "q": element, "block_k": element, "block_v": element, "ctx_k": element, "ctx_v": element, "ctx_len": "*i64",
        "block_positions": "*i64", "ctx_slots": "i32", "block_len": "i32", "out": element,
    }  # fmt: skip
    constexprs = kernel_constexprs(max_block, heads, kv_heads, head_dim, causal, window, scale, False, block_n)
    return KernelSpec(block_denoise_kernel, signature, constexprs, ("batch", "heads"))


def block_denoise_triton(
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
    """The op through its Triton kernel; same arguments and result as `block_denoise`."""
    batch, size, heads, head_dim = q.shape
    constexprs = kernel_constexprs(size, heads, block_k.shape[2], head_dim, causal, window, scale, upcast_dots(q))
    out = torch.empty((batch, size, heads * head_dim), dtype=q.dtype, device=q.device)
    inputs = [t.contiguous() for t in (q, block_k, block_v, ctx_k, ctx_v, ctx_len, block_positions)]
    launch(block_denoise_kernel, (batch, heads), *inputs, ctx_k.shape[1], size, out, **constexprs)
    return out
