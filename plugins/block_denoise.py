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
    batch, ctx_slots = ctx_k.shape[0], ctx_k.shape[1]
    ctx_positions = torch.arange(ctx_slots, device=q.device).expand(batch, -1)  # [B, T]
    key_positions = torch.cat([ctx_positions, block_positions], dim=1)  # [B, T+S]
    key_valid = torch.cat([ctx_positions < ctx_len[:, None], torch.ones_like(block_positions, dtype=torch.bool)], dim=1)
    visible = block_visibility(block_positions, key_positions, key_valid, causal, window)
    keys = torch.cat([ctx_k, block_k], dim=1)
    values = torch.cat([ctx_v, block_v], dim=1)
    return masked_attention(q, keys, values, visible, scale)
