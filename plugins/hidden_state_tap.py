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
    ctx = rms_norm(F.linear(taps, weights.fc), weights.hidden_norm, weights.eps)  # [B, T, E]
    head_dim = weights.k_norm[0].shape[0]
    cos, sin = rotary_cos_sin(weights.inv_freq, weights.rope_scaling, positions, ctx.dtype)
    keys, values = [], []
    for k_w, k_b, v_w, v_b, k_norm in zip(weights.k_proj, weights.k_bias, weights.v_proj, weights.v_bias, weights.k_norm):
        k = F.linear(ctx, k_w, k_b).unflatten(-1, (-1, head_dim))  # [B, T, Hkv, D]
        keys.append(apply_rotary(rms_norm(k, k_norm, weights.eps), cos, sin))
        values.append(F.linear(ctx, v_w, v_b).unflatten(-1, (-1, head_dim)))
    return torch.stack(keys), torch.stack(values)
