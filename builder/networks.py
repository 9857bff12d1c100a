"""Torch networks: the target (logits + tap features, static position-indexed KV cache) and the DFlash drafter.

These are the reference semantics that ONNX export traces. Parameter names match the checkpoints
(HF targets with the leading `model.` stripped; z-lab drafters as stored), so state dicts load directly.
Shapes: B batch, S tokens, T cache slots, L layers, H/Hkv heads, D head dim, E hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn.functional as F
from dflash_trt.builder.checkpoints import (
    CheckpointError,
    DrafterConfig,
    TargetConfig,
    check_pair,
    checkpoint_dtype,
    load_safetensors_dir,
    parse_drafter_config,
    parse_target_config,
    read_config_json,
    require_buildable,
)
from dflash_trt.builder.gated_deltanet import GatedDeltaNet, GDNTape, commit_state, commit_window
from dflash_trt.builder.layers import (
    GatedMLP,
    RMSNorm,
    ZeroCenteredRMSNorm,
    apply_rotary,
    masked_attention,
    rope_inverse_frequencies,
    rotary_cos_sin,
    write_rows,
)
from dflash_trt.plugins.block_denoise import block_denoise
from dflash_trt.plugins.hidden_state_tap import TapWeights, hidden_state_tap
from torch import nn


class PastKV(Protocol):
    """Position-indexed K/V of earlier tokens, per layer: row t holds position t; rows at or past a sequence's
    block start are stale (the attention masks them)."""

    def layer(self, index: int, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, R + room, Hkv, D], same) for layer `index`: the R past rows, then `room` rows for this call's
        keys to be written into at their positions (`write_rows`; what they hold before is masked)."""
        ...


@dataclass
class StackedPast:
    """Past K/V held as stacked tensors: k, v [L, B, R, Hkv, D]."""

    k: torch.Tensor
    v: torch.Tensor

    def layer(self, index: int, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        return with_room(self.k[index], room), with_room(self.v[index], room)


def with_room(past: torch.Tensor, room: int) -> torch.Tensor:
    """past [..., R, Hkv, D] -> [..., R + room, Hkv, D], the added rows zero."""
    return torch.cat([past, past.new_zeros(*past.shape[:-3], room, *past.shape[-2:])], dim=-3)


@dataclass
class PooledPast:
    """Past K/V read straight from an engine's state pool, which graphs take flat: [L * N * T, Hkv, D] (layer-major,
    then slot, then position; the engine binds a view of its [L, N, T, Hkv, D] tensor, so nothing is reshaped or
    copied). Reads the first `rows` positions of each sequence's slot and `room` more (stale rows of the same slot,
    which the engine keeps inside the pool: rows + room <= T), one Gather per layer, whose row numbers for every
    layer are computed once per call."""

    k_pool: torch.Tensor  # [L * N * T, Hkv, D]
    v_pool: torch.Tensor
    layers: int  # L
    positions: int  # T, fixed when the engine is built
    slots: torch.Tensor  # [B]
    rows: int  # R <= T (a symbolic size when exported)
    _layer_rows: torch.Tensor | None = field(default=None, init=False)  # [L, B, R + room], the first `layer` call's

    def __post_init__(self) -> None:
        self._k_rows, self._v_rows = self.k_pool.flatten(1), self.v_pool.flatten(1)  # [L * N * T, Hkv * D]: views

    def row_index(self, room: int) -> torch.Tensor:
        """Flat row numbers of every layer's rows and room: [L, B, R + room], computed on the device."""
        rows_per_layer = self.k_pool.shape[0] // self.layers  # N * T
        layers = torch.arange(self.layers, device=self.slots.device)
        first = layers[:, None] * rows_per_layer + self.slots * self.positions  # [L, B]
        return first[..., None] + torch.arange(self.rows + room, device=self.slots.device)  # [L, B, R + room]

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: [...] flat row numbers -> (k, v) [..., Hkv, D]: one Gather each (an embedding lookup of rows)."""
        row_shape = self.k_pool.shape[1:]
        return F.embedding(rows, self._k_rows).unflatten(-1, row_shape), F.embedding(rows, self._v_rows).unflatten(-1, row_shape)

    def layer(self, index: int, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One call reads every layer with the same room (its token count): the row numbers of all layers are computed
        at the first layer's read instead of once per layer."""
        if self._layer_rows is None:
            self._layer_rows = self.row_index(room)
        elif not torch.compiler.is_exporting() and self._layer_rows.shape[-1] != self.rows + room:
            raise ValueError(f"PooledPast serves one call: its layers were read with room "
                             f"{self._layer_rows.shape[-1] - self.rows}, now {room}")  # fmt: skip
        return self.gather(self._layer_rows[index])  # [B, R + room, Hkv, D]

    def stacked(self, room: int) -> StackedPast:
        """Every layer's rows and room: k, v [L, B, R + room, Hkv, D]."""
        return StackedPast(*self.gather(self.row_index(room)))


@dataclass
class KVCache:
    """Static cache indexed by position (training and tests): row t of a sequence holds its token at position t."""

    k: torch.Tensor  # [L, B, T, Hkv, D]
    v: torch.Tensor  # [L, B, T, Hkv, D]

    @staticmethod
    def allocate(num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCache:
        shape = (num_layers, batch, slots, kv_heads, head_dim)
        return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    def past(self, rows: int) -> StackedPast:
        """The first `rows` positions of every layer."""
        return StackedPast(self.k[:, :, :rows], self.v[:, :, :rows])

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows in place: positions [B, S]; k, v: [L, B, S, Hkv, D]."""
        batch_rows = torch.arange(positions.shape[0], device=positions.device)[:, None]  # [B, 1]
        self.k[:, batch_rows, positions] = k.to(self.k.dtype)
        self.v[:, batch_rows, positions] = v.to(self.v.dtype)


def key_visibility(positions: torch.Tensor, key_rows: int) -> torch.Tensor:
    """positions: [B, S] contiguous from each row's start -> visible [B, S, K] over K position-indexed keys (the
    past rows with the new rows written at their positions, `write_rows`): key t is visible to the token at
    position p iff t <= p. Rows at or past a row's start hold new keys or are stale; the stale ones lie past p."""
    keys = torch.arange(key_rows, device=positions.device)  # [K]
    return keys[None, None, :] <= positions[:, :, None]


class RecurrentState(NamedTuple):
    """The Gated DeltaNet layers' per-sequence state (hybrid targets)."""

    state: torch.Tensor  # [Lg, B, Hv, dk, dv] fp32
    window: torch.Tensor  # [Lg, B, K-1, C]: the last K-1 conv inputs


class TargetOutput(NamedTuple):
    logits: torch.Tensor  # [B, S or logits_to_keep, V]
    taps: torch.Tensor  # [B, S, n_taps*E]
    k: torch.Tensor  # [La, B, S, Hkv, D]: K rows of these positions (attention layers), for the caller's cache
    v: torch.Tensor  # [La, B, S, Hkv, D]
    tapes: tuple[GDNTape, ...] = ()  # per Gated DeltaNet layer: what `commit_recurrent` needs
    recurrent: RecurrentState | None = None  # after all S tokens


def make_norm(config: TargetConfig, size: int) -> nn.Module:
    return ZeroCenteredRMSNorm(size, config.rms_norm_eps) if config.zero_centered_norms else RMSNorm(size, config.rms_norm_eps)


class TargetAttention(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        e, h, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.head_dim, self.gated = d, config.gated_attention
        self.q_proj = nn.Linear(e, h * d * (2 if self.gated else 1), bias=config.qkv_bias)  # gated: [query | gate] per head
        self.k_proj = nn.Linear(e, hkv * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(e, hkv * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h * d, e, bias=config.o_bias)
        self.q_norm = make_norm(config, d) if config.qk_norm else None
        self.k_norm = make_norm(config, d) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, S, E]; positions: [B, S]; visible: [B, S, R + S]; past_k/v: [B, R + S, Hkv, D] position-indexed
        (the past rows and room for these S, `PastKV.layer`) -> (out, k, v [B, S, Hkv, D])."""
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim * (2 if self.gated else 1)))  # [B, S, H, D or 2D]
        q, gate = q.chunk(2, dim=-1) if self.gated else (q, None)  # [B, S, H, D] each
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))  # [B, S, Hkv, D]
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Keys in position order, the new ones written over the stale past rows: the token at position p then sums
        # over keys 0..p in the same order whatever the block (a plain decode step or a verify block), so its
        # attention output does not depend on how tokens were grouped into calls (bitwise, on ONNX Runtime).
        keys, values = write_rows(past_k, k, positions), write_rows(past_v, v, positions)  # [B, R + S, Hkv, D]
        out = masked_attention(q, keys, values, visible, self.head_dim**-0.5)  # [B, S, H*D]
        if gate is not None:
            out = out * torch.sigmoid(gate.flatten(-2))
        return self.o_proj(out), k, v


class TargetLayer(nn.Module):
    """One decoder layer with (full) attention."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = TargetAttention(config)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, positions, visible, past_k, past_v)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class LinearAttentionLayer(nn.Module):
    """One decoder layer of a hybrid target whose token mixer is Gated DeltaNet (`linear_attn`)."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        assert config.linear is not None
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.linear_attn = GatedDeltaNet(config.hidden_size, config.linear, config.rms_norm_eps)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act)

    def forward(
        self, x: torch.Tensor, window: torch.Tensor | None, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, GDNTape]:
        mixed, state, tape = self.linear_attn(self.input_layernorm(x), window, state)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x)), state, tape


class TargetNetwork(nn.Module):
    """Decoder-only target returning logits and the concatenated outputs of the tap layers. Hybrid targets
    (qwen3_5) interleave Gated DeltaNet layers, whose state enters and leaves as a `RecurrentState`."""

    def __init__(self, config: TargetConfig, tap_layer_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.config = config
        self.tap_layer_ids = tap_layer_ids
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        linear = set(config.linear_layers)
        self.layers = nn.ModuleList(
            LinearAttentionLayer(config) if i in linear else TargetLayer(config) for i in range(config.num_layers)
        )
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        inv_freq, self.rope_scaling = rope_inverse_frequencies(config.rope_parameters, rotary_dim, config.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tie_weights(self) -> None:
        """The LM head reads the embedding's matrix when the checkpoint ties them (again after loading assigns it)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def allocate_cache(self, batch: int, slots: int) -> KVCache:
        c = self.config
        layers = len(c.attention_layers)
        return KVCache.allocate(layers, batch, slots, c.num_kv_heads, c.head_dim, self.embed_tokens.weight.dtype)

    def commit_recurrent(self, before: RecurrentState, tapes: tuple[GDNTape, ...], committed: torch.Tensor) -> RecurrentState:
        """The state after the first `committed` [B] tokens of a block, from the state before it and its tapes."""
        assert self.config.linear is not None
        kernel = self.config.linear.conv_kernel
        states = [commit_state(before.state[i], tape, committed) for i, tape in enumerate(tapes)]
        windows = [commit_window(tape.window, committed, kernel) for tape in tapes]
        return RecurrentState(torch.stack(states), torch.stack(windows))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        past: PastKV,
        logits_to_keep: int = 0,
        recurrent: RecurrentState | None = None,
    ) -> TargetOutput:
        """input_ids, positions: [B, S] (contiguous per row); past: R position-indexed rows per attention layer
        (R may be 0); recurrent: the Gated DeltaNet state before these tokens (hybrid targets; None = empty)."""
        x = self.embed_tokens(input_ids)  # [B, S, E]
        cos, sin = rotary_cos_sin(self.inv_freq, self.rope_scaling, positions, x.dtype)
        visible: torch.Tensor | None = None
        taps: dict[int, torch.Tensor] = {}
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        tapes: list[GDNTape] = []
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionLayer):
                g = len(tapes)
                before = (None, None) if recurrent is None else (recurrent.window[g], recurrent.state[g])
                x, state, tape = layer(x, *before)
                states.append(state)
                tapes.append(tape)
            else:
                past_k, past_v = past.layer(len(new_k), input_ids.shape[1])  # [B, R + S, Hkv, D]
                if visible is None:
                    visible = key_visibility(positions, past_k.shape[1])  # [B, S, R + S], shared by every layer
                x, k, v = layer(x, cos, sin, positions, visible, past_k, past_v)
                new_k.append(k)
                new_v.append(v)
            if index in self.tap_layer_ids and index != last:
                taps[index] = x
        x = self.norm(x)
        if last in self.tap_layer_ids:
            taps[last] = x  # HF's hidden_states[-1] is the final-normed output
        tap_features = torch.cat([taps[i] for i in self.tap_layer_ids], dim=-1) if self.tap_layer_ids else x[..., :0]
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        after = None
        if tapes:  # the window after the block: the last K-1 of [old window ; block inputs]
            after = RecurrentState(torch.stack(states), torch.stack([t.window[:, input_ids.shape[1] :] for t in tapes]))
        return TargetOutput(logits, tap_features, torch.stack(new_k), torch.stack(new_v), tuple(tapes), after)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig, causal: bool, window: int | None) -> None:
        super().__init__()
        e, h, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.head_dim, self.causal, self.window, self.max_block = d, causal, window, config.block_size
        self.q_proj = nn.Linear(e, h * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(e, hkv * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(e, hkv * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h * d, e, bias=config.qkv_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_len: torch.Tensor,
    ) -> torch.Tensor:
        # x: [B, S, E] normed block; ctx_k, ctx_v: [B, T, Hkv, D]
        q = apply_rotary(self.q_norm(self.q_proj(x).unflatten(-1, (-1, self.head_dim))), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).unflatten(-1, (-1, self.head_dim))), cos, sin)
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        scale = self.head_dim**-0.5
        out = block_denoise(q, k, v, ctx_k, ctx_v, ctx_len, positions, self.causal, self.window, scale, self.max_block)
        return self.o_proj(out)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, causal: bool, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, causal, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, False, config.hidden_act)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_len: torch.Tensor,
    ) -> torch.Tensor:
        # x: [B, S, E] block hidden; ctx_k, ctx_v: [B, T, Hkv, D] this layer's context rows
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, ctx_k, ctx_v, ctx_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class DrafterNetwork(nn.Module):
    """DFlash drafter: KV injection of the fused target context into every layer, one pass per block."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        n_taps = len(config.target_layer_ids)
        self.fc = nn.Linear(n_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DrafterLayer(config, causal, window) for causal, window in zip(config.layer_causal, config.layer_window, strict=True)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq, self.rope_scaling = rope_inverse_frequencies(
            config.rope_parameters, config.head_dim, config.max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def allocate_cache(self, batch: int, slots: int) -> KVCache:
        c = self.config
        return KVCache.allocate(c.num_layers, batch, slots, c.num_kv_heads, c.head_dim, self.fc.weight.dtype)

    def tap_weights(self) -> TapWeights:
        attns = [cast(DrafterLayer, layer).self_attn for layer in self.layers]
        return TapWeights(
            fc=self.fc.weight,
            hidden_norm=self.hidden_norm.weight,
            k_proj=[a.k_proj.weight for a in attns],
            k_bias=[a.k_proj.bias for a in attns],
            v_proj=[a.v_proj.weight for a in attns],
            v_bias=[a.v_proj.bias for a in attns],
            k_norm=[a.k_norm.weight for a in attns],
            inv_freq=self.inv_freq,
            rope_scaling=self.rope_scaling,
            eps=self.config.rms_norm_eps,
        )

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """taps: [B, T, n_taps*E], positions: [B, T] -> ctx K, V: [L, B, T, Hkv, D] (the HiddenStateTap op)."""
        return hidden_state_tap(taps.to(self.fc.weight.dtype), positions, self.tap_weights())

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_len: torch.Tensor,
    ) -> torch.Tensor:
        """block_embeds: [B, S, E], block_positions: [B, S], ctx_k/ctx_v: [L, B, T, Hkv, D] position-indexed
        context rows (rows at or past ctx_len [B] are invisible) -> normed hidden [B, S, E]."""
        x = block_embeds
        cos, sin = rotary_cos_sin(self.inv_freq, self.rope_scaling, block_positions, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, block_positions, ctx_k[index], ctx_v[index], ctx_len)
        return self.norm(x)


def draft_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, config: DrafterConfig) -> torch.Tensor:
    """hidden: [B, S, E] -> logits [B, S, V] through the target's lm_head (drafters carry none)."""
    logits = F.linear(hidden, lm_head_weight)
    if config.output_multiplier != 1.0:  # x * 1.0 is x: no pass over [B, S, V] for nothing
        logits = logits * config.output_multiplier
    if config.final_logit_softcapping is not None:
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def _load_state(module: nn.Module, state: dict[str, torch.Tensor], where: str, ignore: tuple[str, ...] = ()) -> None:
    """Give a network built on the meta device the checkpoint's tensors themselves (`assign`: no copy, and no
    randomly initialised parameters beside them); every parameter must come from the checkpoint."""
    expected = {name for name in module.state_dict() if not name.startswith(ignore)}
    missing = sorted(expected - set(state))
    if missing:
        raise CheckpointError(f"{where}: weights missing from the safetensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    module.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)


def load_target(checkpoint_dir: Path, tap_layer_ids: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> TargetNetwork:
    """Load an HF llama/qwen2/qwen3/qwen3_5 checkpoint directory as a TargetNetwork (eval mode), holding one copy of
    its weights in `dtype` (default: the checkpoint's)."""
    config = parse_target_config(read_config_json(checkpoint_dir), where=str(checkpoint_dir))
    require_buildable(config, str(checkpoint_dir))
    with torch.device("meta"):
        network = TargetNetwork(config, tap_layer_ids)
    dtype = dtype or config.dtype
    ignore = ("lm_head",) if config.tie_word_embeddings else ()
    _load_state(network, load_safetensors_dir(checkpoint_dir, dtype), str(checkpoint_dir), ignore)
    network.tie_weights()
    return network.to(dtype).eval()  # the RoPE buffers; the weights are in dtype already


def load_drafter(checkpoint_dir: Path, dtype: torch.dtype | None = None) -> DrafterNetwork:
    """Load a z-lab DFlash drafter directory (either config schema) as a DrafterNetwork (eval mode)."""
    raw = read_config_json(checkpoint_dir)
    config = parse_drafter_config(raw, where=str(checkpoint_dir))
    dtype = dtype or checkpoint_dtype(raw)
    with torch.device("meta"):
        network = DrafterNetwork(config)
    _load_state(network, load_safetensors_dir(checkpoint_dir, dtype), str(checkpoint_dir))
    return network.to(dtype).eval()  # the RoPE buffers; the weights are in dtype already


def load_pair(target_dir: Path, drafter_dir: Path, dtype: torch.dtype | None = None) -> tuple[TargetNetwork, DrafterNetwork]:
    """Load a target and its drafter, checking first that they fit (hidden size, mask id, tap layers)."""
    target_config = parse_target_config(read_config_json(target_dir), where=str(target_dir))
    require_buildable(target_config, str(target_dir))
    drafter_config = parse_drafter_config(read_config_json(drafter_dir), where=str(drafter_dir))
    check_pair(target_config, drafter_config)
    target = load_target(target_dir, drafter_config.target_layer_ids, dtype)
    return target, load_drafter(drafter_dir, dtype or target_config.dtype)
