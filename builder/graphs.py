"""The fused graphs that become engines: prefill, step (the in-engine draft-verify loop body), verify and decode.

prefill: prompt -> target (last logits, taps) -> first token -> draft-context rows -> first draft block
step:    block -> target verify -> sample every slot -> accept -> draft-context rows -> next draft block
verify:  the same without drafting (DFlash verifying nothing: the next block is the bonus token alone)
decode:  block -> target -> tokens (plain decoding on the same engine: no taps, no draft context)

Inputs and outputs are those of `runtime.graph_io` (one schema for export, runners and profiles). Step-like
graphs read the engine's state pool by slot and position, and return only the rows they computed, which the
engine writes into the pool in place. Rows past a sequence's committed length are stale and masked by
position. Every graph runs eagerly as the torch reference engine and exports to ONNX unchanged.
"""

from __future__ import annotations

import torch
from dflash_trt.builder.checkpoints import DrafterConfig, TargetConfig
from dflash_trt.builder.layers import write_rows
from dflash_trt.builder.networks import (
    DrafterNetwork,
    PooledPast,
    RecurrentState,
    TargetNetwork,
    TargetOutput,
    draft_logits,
)
from dflash_trt.runtime.engine import EngineSpec, GraphEngine, TorchRunner
from dflash_trt.runtime.graph_io import GRAPH_NAMES
from dflash_trt.runtime.sampling import accepted_prefix_length, sample_tokens
from dflash_trt.runtime.states import StateSpec, attention_states, gated_deltanet_states
from torch import nn

Outputs = tuple[torch.Tensor, ...]


def engine_spec(
    target: TargetNetwork, drafter: DrafterNetwork, block_size: int, max_seq_len: int, max_batch_size: int
) -> EngineSpec:
    """The engine description of a loaded pair: its sizes and states."""
    t, d = target.config, drafter.config
    dtype = str(target.embed_tokens.weight.dtype).removeprefix("torch.")
    states = engine_states(t, d, max_seq_len + block_size, dtype)
    return EngineSpec(block_size, max_seq_len, max_batch_size, t.vocab_size, d.mask_token_id, dtype, states)


def engine_states(t: TargetConfig, d: DrafterConfig, positions: int, dtype: str) -> tuple[StateSpec, ...]:
    """What an engine keeps per sequence, from the configs alone: attention K/V of the target and the draft context
    for `positions` rows (max_seq_len + block_size: a verify block may write up to block_size - 1 rows past the last
    token), and for hybrid targets the Gated DeltaNet state and conv window (recurrent states last)."""
    states = (
        *attention_states("target", len(t.attention_layers), positions, t.num_kv_heads, t.head_dim, dtype),
        *attention_states("draft", d.num_layers, positions, d.num_kv_heads, d.head_dim, dtype),
    )
    if t.linear is None:
        return states
    g = t.linear
    shape = (g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel, g.conv_dim)
    return (*states, *gated_deltanet_states("target", len(t.linear_layers), *shape, dtype))


class DFlashGraphs(nn.Module):
    """Target + drafter; the graph bodies are methods, wrapped as modules for export below."""

    def __init__(self, target: TargetNetwork, drafter: DrafterNetwork, block_size: int, positions: int) -> None:
        super().__init__()
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.positions = positions  # T: rows per sequence of the positional states (max_seq_len + block_size)
        self.mask_token_id = drafter.config.mask_token_id
        self.rollback = True  # False keeps the recurrent state of the whole block: only to show, in tests, why not

    def draft_block(
        self, first_token: torch.Tensor, start: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, drafts: int
    ) -> torch.Tensor:
        """first_token, start: [B]; ctx_k/v: [Ld, B, T, Hkv, D] position-indexed, rows < start visible -> block [B, 1 + drafts].

        The drafter denoises the first 1 + drafts slots of the block, not all of it: the mask slots past the used
        ones cost as much again and barely move the used ones (`scripts/drafter_acceptance.py --block-slots S`, the
        demo drafter on 20 HumanEval answers x 128 tokens: the first draft accepted at 0.404 of the anchors from a
        2-slot block, 0.416 from the whole block; the first two at 0.217 from 3 slots, 0.224 from 16)."""
        offsets = torch.arange(1 + drafts, device=start.device)
        masks = torch.full_like(offsets, self.mask_token_id)[None, :].expand(start.shape[0], -1)
        block = torch.cat([first_token[:, None], masks[:, 1:]], dim=1)  # [B, S]
        embeds = self.target.embed_tokens(block) * self.drafter.config.input_embedding_scale  # the target's table
        hidden = self.drafter(embeds.to(ctx_k.dtype), start[:, None] + offsets, ctx_k, ctx_v, start)
        lm_head = self.target.lm_head.weight.to(hidden.dtype)
        if self.drafter.config.output_multiplier > 0:  # scaling and softcapping keep the argmax: skip them
            logits = torch.nn.functional.linear(hidden[:, 1 : 1 + drafts], lm_head)
        else:
            logits = draft_logits(hidden[:, 1 : 1 + drafts], lm_head, self.drafter.config)
        return torch.cat([first_token[:, None], logits.argmax(dim=-1)], dim=1)  # slot j predicts the token at slot j

    def prefill(
        self,
        input_ids: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        visible_rows: torch.Tensor,
        uniforms: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        sampled_rows: torch.Tensor,
        candidate_slots: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        draft_k: torch.Tensor,
        draft_v: torch.Tensor,
        target_ssm: torch.Tensor | None = None,
        target_conv: torch.Tensor | None = None,
    ) -> Outputs:
        """input_ids: [B, P] at positions start..start+P-1, after the rows < start of each slot (a reused prefix;
        start 0: none); uniforms: [B, 1]. Hybrid targets continue the slot's recurrent states where start > 0 (they
        hold exactly the first `start` tokens) and start from zero where start = 0."""
        batch, length = input_ids.shape
        positions = start[:, None] + torch.arange(length, device=input_ids.device)[None, :]  # [B, P]
        past = self._pooled("target", target_k, target_v, slots, visible_rows)
        before = self._pooled_recurrent(target_ssm, target_conv, slots)
        if before is not None:
            before = RecurrentState(*(torch.where(_rows_mask(start > 0, s), s, 0.0) for s in before))
        out = self.target(input_ids, positions, past, logits_to_keep=1, recurrent=before)
        first = sample_tokens(out.logits, uniforms, temperature, top_k, top_p, sampled_rows, candidate_slots)[:, 0]  # [B]
        ctx_rows = self.drafter.context_kv(out.taps, positions)  # [Ld, B, P, Hkv, D] each
        ctx_k, ctx_v = self._draft_context(draft_k, draft_v, slots, visible_rows, ctx_rows, positions)
        next_block = self.draft_block(first, start + length, ctx_k, ctx_v, self.block_size - 1)
        return first, next_block, out.k, out.v, *ctx_rows, *(out.recurrent or ())

    def step(
        self,
        block: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        visible_rows: torch.Tensor,
        uniforms: torch.Tensor,
        draft_slots: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        sampled_rows: torch.Tensor,
        candidate_slots: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        draft_k: torch.Tensor,
        draft_v: torch.Tensor,
        target_ssm: torch.Tensor | None = None,
        target_conv: torch.Tensor | None = None,
    ) -> Outputs:
        """block: [B, V] at positions start..start+V-1; uniforms: [B, V]; states: the pool, flat; draft_slots: [K]
        -> next_block [B, 1 + K]."""
        sampling = (temperature, top_k, top_p, sampled_rows, candidate_slots)
        tokens, accept_len, next_start, target_rows, ctx_rows = self._verify(
            block, start, slots, visible_rows, uniforms, sampling, target_k, target_v, target_ssm, target_conv
        )
        # The drafter sees its context rows up to next_start: the pool's rows < start, then this block's accepted ones.
        positions = start[:, None] + torch.arange(block.shape[1], device=block.device)  # [B, V]
        ctx_k, ctx_v = self._draft_context(draft_k, draft_v, slots, visible_rows, ctx_rows, positions)
        bonus = tokens.gather(1, accept_len[:, None])[:, 0]  # [B]
        next_block = self.draft_block(bonus, next_start, ctx_k, ctx_v, draft_slots.shape[0])
        return tokens, accept_len, next_block, next_start, *target_rows[:2], *ctx_rows, *target_rows[2:]

    def verify(
        self,
        block: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        visible_rows: torch.Tensor,
        uniforms: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        sampled_rows: torch.Tensor,
        candidate_slots: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        target_ssm: torch.Tensor | None = None,
        target_conv: torch.Tensor | None = None,
    ) -> Outputs:
        """The step without drafting: next_block is the bonus token [B, 1]; the draft context still grows."""
        sampling = (temperature, top_k, top_p, sampled_rows, candidate_slots)
        tokens, accept_len, next_start, target_rows, ctx_rows = self._verify(
            block, start, slots, visible_rows, uniforms, sampling, target_k, target_v, target_ssm, target_conv
        )
        bonus = tokens.gather(1, accept_len[:, None])  # [B, 1]
        return tokens, accept_len, bonus, next_start, *target_rows[:2], *ctx_rows, *target_rows[2:]

    def decode(
        self,
        block: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        visible_rows: torch.Tensor,
        uniforms: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        sampled_rows: torch.Tensor,
        candidate_slots: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        target_ssm: torch.Tensor | None = None,
        target_conv: torch.Tensor | None = None,
    ) -> Outputs:
        """Plain decoding (block [B, 1] in practice): the target alone, no taps."""
        positions = start[:, None] + torch.arange(block.shape[1], device=block.device)  # [B, V]
        before = self._pooled_recurrent(target_ssm, target_conv, slots)
        out = self.target(block, positions, self._pooled("target", target_k, target_v, slots, visible_rows), recurrent=before)
        tokens = sample_tokens(out.logits, uniforms, temperature, top_k, top_p, sampled_rows, candidate_slots)
        accept_len = accepted_prefix_length(block[:, 1:], tokens)  # [B]
        bonus = tokens.gather(1, accept_len[:, None])  # [B, 1]
        return tokens, accept_len, bonus, start + accept_len + 1, out.k, out.v, *self._committed(before, out, accept_len)

    def _verify(
        self,
        block: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
        visible_rows: torch.Tensor,
        uniforms: torch.Tensor,
        sampling: tuple[torch.Tensor, ...],
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        target_ssm: torch.Tensor | None,
        target_conv: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
        """Verify, sample every slot, accept, tap: (tokens [B, V], accept_len [B], next_start [B], target rows (K, V,
        then for hybrid targets the committed recurrent state and window), ctx rows)."""
        positions = start[:, None] + torch.arange(block.shape[1], device=block.device)  # [B, V]
        before = self._pooled_recurrent(target_ssm, target_conv, slots)
        out = self.target(block, positions, self._pooled("target", target_k, target_v, slots, visible_rows), recurrent=before)
        tokens = sample_tokens(out.logits, uniforms, *sampling)  # [B, V]
        accept_len = accepted_prefix_length(block[:, 1:], tokens)  # [B]
        # Tap every slot; rows past the accepted ones are invisible (>= next_start) and get overwritten later.
        ctx_k, ctx_v = self.drafter.context_kv(out.taps, positions)  # [Ld, B, V, Hkv, D]
        target_rows = (out.k, out.v, *self._committed(before, out, accept_len))
        return tokens, accept_len, start + accept_len + 1, target_rows, (ctx_k, ctx_v)

    def _committed(self, before: RecurrentState | None, out: TargetOutput, accept_len: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Hybrid targets: the Gated DeltaNet state and window after the accept_len + 1 committed tokens (rolled back
        from the block's tapes inside the graph); () for targets without recurrent layers."""
        if before is None or out.recurrent is None:
            return ()
        if not self.rollback:
            return tuple(out.recurrent)
        return tuple(self.target.commit_recurrent(before, out.tapes, accept_len + 1))

    def _pooled_recurrent(
        self, ssm: torch.Tensor | None, conv: torch.Tensor | None, slots: torch.Tensor
    ) -> RecurrentState | None:
        """The recurrent states of these slots from the pool (flat [Lg * N, *shape]) -> [Lg, B, *shape] each."""
        if ssm is None or conv is None:
            return None
        layers = len(self.target.config.linear_layers)
        index = (torch.arange(layers, device=slots.device)[:, None] * (ssm.shape[0] // layers) + slots[None, :]).reshape(-1)
        return RecurrentState(
            ssm.index_select(0, index).unflatten(0, (layers, -1)), conv.index_select(0, index).unflatten(0, (layers, -1))
        )

    def _draft_context(
        self,
        draft_k: torch.Tensor,
        draft_v: torch.Tensor,
        slots: torch.Tensor,
        visible_rows: torch.Tensor,
        ctx_rows: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's context for the next block: the pool's rows of these slots with this call's new rows
        (ctx_rows [Ld, B, S, Hkv, D] each, at positions [B, S]) written in -> k, v [Ld, B, R + S, Hkv, D]."""
        past = self._pooled("draft", draft_k, draft_v, slots, visible_rows).stacked(positions.shape[1])
        return write_rows(past.k, ctx_rows[0], positions), write_rows(past.v, ctx_rows[1], positions)

    def _pooled(
        self, owner: str, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, visible_rows: torch.Tensor
    ) -> PooledPast:
        """The pool of the target's or the drafter's K/V (flat [L * N * T, Hkv, D]) read for these slots."""
        layers = len(self.target.config.attention_layers) if owner == "target" else self.drafter.config.num_layers
        return PooledPast(k_pool, v_pool, layers, self.positions, slots, visible_rows.shape[0])


class PrefillGraph(DFlashGraphs):
    """Export entry: forward is `prefill`."""

    forward = DFlashGraphs.prefill


class StepGraph(DFlashGraphs):
    forward = DFlashGraphs.step


class VerifyGraph(DFlashGraphs):
    forward = DFlashGraphs.verify


class DecodeGraph(DFlashGraphs):
    forward = DFlashGraphs.decode


GRAPH_MODULES: dict[str, type[DFlashGraphs]] = {
    "prefill": PrefillGraph,
    "step": StepGraph,
    "verify": VerifyGraph,
    "decode": DecodeGraph,
}
assert tuple(GRAPH_MODULES) == GRAPH_NAMES


def _rows_mask(rows: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """rows: [B] bool -> shaped to broadcast over states [L, B, ...]."""
    return rows.reshape(1, -1, *([1] * (states.dim() - 2)))


def graph_module(graphs: DFlashGraphs, name: str) -> DFlashGraphs:
    """The same target and drafter behind one graph's forward, for export."""
    return GRAPH_MODULES[name](graphs.target, graphs.drafter, graphs.block_size, graphs.positions).eval()


def torch_engine(
    target: TargetNetwork,
    drafter: DrafterNetwork,
    max_seq_len: int,
    block_size: int | None = None,
    max_batch: int = 1,
    device: torch.device | str = "cpu",
) -> GraphEngine:
    """The torch engine for a loaded pair, with a pool of `max_batch` slots on `device`: the reference on the CPU,
    the torch-cuda backend on a GPU."""
    if tuple(target.tap_layer_ids) != tuple(drafter.config.target_layer_ids):
        raise ValueError(
            f"target taps {target.tap_layer_ids} != drafter target_layer_ids {drafter.config.target_layer_ids}; "
            "load the pair with load_pair()"
        )
    if not 0 < max_seq_len <= target.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_len={max_seq_len} must be in [1, {target.config.max_position_embeddings}] "
            "(the target's max_position_embeddings)"
        )
    size = block_size or drafter.config.block_size
    spec = engine_spec(target, drafter, size, max_seq_len, max_batch)
    runner = TorchRunner(DFlashGraphs(target, drafter, size, spec.positions), spec, device)
    return GraphEngine(runner, spec, max_batch, device)
