"""Transformer building blocks shared by the target and drafter networks (Llama/Qwen conventions).

Shapes: B batch, S query tokens, T key slots, H heads, Hkv key/value heads, D head dim, E hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Llama/Qwen do."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w), all in fp32 and cast at the end (Qwen3.5: the weight is stored centred on 0)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, in fp32 (every RMSNorm variant starts here; they differ in the scaling).

    Eager, as transformers computes it (times `rsqrt`), bitwise: the torch engine's hidden states equal transformers'.
    Exported, as a division by the square root (the two differ by an ulp at most): the pattern ONNX Runtime's graph
    optimizer fuses into one SimplifiedLayerNormalization kernel per norm, where `rsqrt` stays six kernels (Pow,
    ReduceMean, Add, Sqrt, Reciprocal, Mul); the file keeps standard operators either way."""
    x32 = x.to(torch.float32)
    mean_square = x32.pow(2).mean(-1, keepdim=True) + eps
    if torch.compiler.is_exporting():
        return x32 / torch.sqrt(mean_square)
    return x32 * torch.rsqrt(mean_square)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * rms_normalize(x, eps).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; Llama/Qwen checkpoints use 'silu'")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inverse_frequencies(rope_parameters: dict[str, Any], head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2], attention_scaling) for a static RoPE type, computed by transformers' own init functions."""
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        dims = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # real under meta too
        return 1.0 / (float(rope_parameters["rope_theta"]) ** dims), 1.0
    config = PretrainedConfig()
    config.rope_parameters = dict(rope_parameters)
    config.head_dim = head_dim
    config.hidden_size = head_dim
    config.num_attention_heads = 1
    config.max_position_embeddings = max_positions
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


def rotary_cos_sin(
    inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, S] -> (cos, signed_sin): [B, S, D], the angles' halves repeated; signed_sin carries the
    rotation's sign on its first half (-sin, sin), which `apply_rotary` would otherwise negate the rotated input
    for in every layer."""
    freqs = positions[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    ones = torch.ones_like(inv_freq, dtype=torch.float32)  # [D/2]: a constant once exported
    signs = torch.cat((-ones, ones))  # [D]
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling * signs).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; cos, signed_sin: [B, S, Dr] (`rotary_cos_sin`) with Dr <= D: partial rotary turns the first
    Dr dims only. x * cos + (x2, x1) * (-sin, sin): bitwise the usual x * cos + (-x2, x1) * sin (a product's sign is
    exact), one negation per graph instead of one per layer."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rotary], cos, signed_sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + swapped * signed_sin[:, :, None, :]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with grouped K/V heads, the G query heads of a K/V head folded into its query axis
    (query head h reads K/V head h // G), so K and V are never repeated, and every call has at least G query rows
    per head (a one-row matmul rounds differently from a many-row one; see docs/quantization.md, Exactness).

    q: [B, S, H, D]; k, v: [B, T, Hkv, D]; visible: [B, S, T] bool -> [B, S, H*D]
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    mask = visible[:, None, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * length, -1)  # [B, 1, G*S, T]
    if torch.compiler.is_exporting():
        # ONNX `Attention` in its 3-D form, one head per K/V head: keys and values are read where they lie
        # ([B, T, Hkv*D], no transposes of the context), the query rows of a head in the same (G, S) order.
        q_rows = q.reshape(batch, length, kv_heads, groups, head_dim).permute(0, 3, 1, 2, 4)  # [B, G, S, Hkv, D]
        out, *_ = torch.onnx.ops.attention(
            q_rows.reshape(batch, groups * length, kv_heads * head_dim),
            k.flatten(2),
            v.flatten(2),
            mask,
            q_num_heads=kv_heads,
            kv_num_heads=kv_heads,
            scale=scale,
        )  # [B, G*S, Hkv*D]
        out = out.reshape(batch, groups, length, kv_heads, head_dim).permute(0, 2, 3, 1, 4)  # [B, S, Hkv, G, D]
        return out.reshape(batch, length, heads * head_dim)
    q_t = q.reshape(batch, length, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, S, D]
    q_t = q_t.reshape(batch, kv_heads, groups * length, head_dim)
    out = F.scaled_dot_product_attention(q_t, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    out = out.reshape(batch, kv_heads, groups, length, head_dim).permute(0, 3, 1, 2, 4)  # [B, S, Hkv, G, D]
    return out.reshape(batch, length, heads * head_dim)


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Position-indexed rows after a write: buffer [..., B, K, H, D] (row t = position t: the past rows and room
    for these, `PastKV.layer`), rows [..., B, S, H, D] at positions [B, S] (each < K) -> the buffer with
    rows[..., b, j] at row positions[b, j]. Functional: the caller's static cache gets the same rows written
    separately, so nothing is copied back."""
    index = positions[:, :, None, None].expand_as(rows)
    return buffer.scatter(-3, index, rows)
