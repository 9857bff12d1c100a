"""Gated DeltaNet (Qwen3.5's linear-attention layers) with exact rollback for speculative verification.

A GDN layer keeps, per sequence, a recurrent state S [Hv, dk, dv] (fp32) and the last K-1 inputs of its causal
conv (the conv window [K-1, C]). Verifying a block runs every block token through the recurrence, rejected drafts
included, so the state after the block is not the state after the accepted tokens. The layer therefore also
returns a tape: the block's per-token recurrence inputs (k, v, g, beta after the conv, the l2 norm and the gates)
and [old window ; block inputs]. Once n tokens are committed, `commit_state` re-runs the recurrence from the
pre-block state over the tape with the gates of tokens t >= n masked (g*[t<n], beta*[t<n]: S*exp(0) and S + k*0,
exactly S), which is bit-identical to running only the first n tokens, and `commit_window` slices the window at n.
Nothing per token is kept between steps: memory per sequence stays one state and one window.

The recurrence (the dflash::GatedDeltaRule op) mirrors transformers' `torch_recurrent_gated_delta_rule` (fp32,
token by token); prefill uses it too. Shapes: B batch, S tokens, Hk/Hv key/value heads, dk/dv head dims,
C conv channels (2*Hk*dk + Hv*dv), K kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from dflash_trt.builder.checkpoints import LinearAttentionConfig
from dflash_trt.builder.layers import rms_norm
from dflash_trt.plugins.causal_conv1d import causal_conv1d
from dflash_trt.plugins.gated_delta_rule import gated_delta_rule
from torch import nn


class GDNTape(NamedTuple):
    """What one GDN layer saw in a block, enough to recompute its state after any prefix of it."""

    k: torch.Tensor  # [B, S, Hv, dk] fp32, l2-normed, repeated over the value heads
    v: torch.Tensor  # [B, S, Hv, dv] fp32
    g: torch.Tensor  # [B, S, Hv] fp32 log decay (<= 0)
    beta: torch.Tensor  # [B, S, Hv] fp32
    window: torch.Tensor  # [B, K-1+S, C]: the old conv window, then the block's conv inputs


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last axis (transformers' form; FLA divides by sqrt(sum) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def commit_state(state: torch.Tensor, tape: GDNTape, committed: torch.Tensor) -> torch.Tensor:
    """The state after the first `committed` [B] tokens of the block (1..S): the recurrence re-run from the
    pre-block state [B, Hv, dk, dv] with the gates of later tokens masked to the identity."""
    length = tape.k.shape[1]
    keep = (torch.arange(length, device=committed.device)[None, :] < committed[:, None]).to(torch.float32)  # [B, S]
    unused_q = torch.zeros_like(tape.k[:, :, :, :1])  # the outputs are not needed
    _, committed_state = gated_delta_rule(
        unused_q.expand_as(tape.k), tape.k, tape.v, tape.g * keep[..., None], tape.beta * keep[..., None], state
    )
    return committed_state


def commit_window(window: torch.Tensor, committed: torch.Tensor, kernel: int) -> torch.Tensor:
    """window: [B, K-1+S, C] (old window ; block inputs) -> [B, K-1, C], the K-1 inputs before token `committed`."""
    rows = committed[:, None] + torch.arange(kernel - 1, device=committed.device)[None, :]  # [B, K-1]
    return window.gather(1, rows[:, :, None].expand(-1, -1, window.shape[-1]))


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with a plain weight (not 1 + w), gated by silu(z) in fp32: transformers' Qwen3_5RMSNormGated."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.weight, self.eps) * F.silu(gate.to(torch.float32))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer; parameter names match the checkpoints (`linear_attn.*`)."""

    def __init__(self, hidden_size: int, config: LinearAttentionConfig, eps: float) -> None:
        super().__init__()
        self.config = config
        c = config
        self.in_proj_qkv = nn.Linear(hidden_size, c.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, c.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, c.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, c.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(c.num_value_heads))
        self.norm = GatedRMSNorm(c.value_head_dim, eps)
        self.out_proj = nn.Linear(c.value_dim, hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, window: torch.Tensor | None, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, GDNTape]:
        """x: [B, S, E]; window: [B, K-1, C] (the inputs before this block); state: [B, Hv, dk, dv] fp32; None for
        both: an empty sequence -> (out [B, S, E], state after all S tokens, the block's tape)."""
        c = self.config
        mixed = self.in_proj_qkv(x)  # [B, S, C]
        if window is None:  # zeros shaped after the input, not from symbolic sizes (an exported Scan needs that)
            window = torch.zeros_like(mixed[:, :1]).expand(-1, c.conv_kernel - 1, -1)
        mixed, extended = causal_conv1d(mixed, window.to(mixed.dtype), self.conv1d.weight)  # [B, S, C], [B, K-1+S, C]
        q, k, v = torch.split(mixed, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
        repeat = c.num_value_heads // c.num_key_heads  # value head j reads key head j // repeat
        q = l2norm(q.unflatten(-1, (c.num_key_heads, c.key_head_dim)).float()).repeat_interleave(repeat, dim=2)
        k = l2norm(k.unflatten(-1, (c.num_key_heads, c.key_head_dim)).float()).repeat_interleave(repeat, dim=2)
        v = v.unflatten(-1, (c.num_value_heads, c.value_head_dim)).float()  # [B, S, Hv, dv]
        beta = self.in_proj_b(x).sigmoid().float()  # [B, S, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [B, S, Hv]
        if state is None:
            state = torch.zeros_like(k[:, 0, :, :, None] * v[:, 0, :, None, :])  # [B, Hv, dk, dv]
        out, final_state = gated_delta_rule(q / c.key_head_dim**0.5, k, v, g, beta, state)
        z = self.in_proj_z(x).unflatten(-1, (c.num_value_heads, c.value_head_dim))
        out = self.norm(out.to(x.dtype), z).flatten(-2)  # [B, S, Hv*dv]
        return self.out_proj(out), final_state, GDNTape(k, v, g, beta, extended)
