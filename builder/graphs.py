"""The fused graphs that become engines: prefill, step (the in-engine draft-verify loop body) and plain decode.

prefill: prompt -> target (last logits, taps) -> first token -> draft-context rows -> first draft block
step:    block -> target verify -> sample every slot -> accept -> draft-context rows -> next draft block
decode:  one token -> target -> next token (the plain-decoding baseline on the same engine)

Caches are position-indexed and functional: a graph reads the first T rows of each cache (T = the largest
start in the batch) and returns only the rows it computed, which the runtime writes into its static cache
(TensorRT can alias them in place). Rows past a sequence's committed length are stale and masked by position.
Every graph runs eagerly as the torch reference engine and exports to ONNX unchanged.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from dflash_trt.builder.layers import write_rows
from dflash_trt.builder.networks import DrafterNetwork, TargetNetwork, draft_logits
from dflash_trt.runtime.sampling import accepted_prefix_length, sample_tokens
from torch import nn


class PrefillOutput(NamedTuple):
    first_token: torch.Tensor  # [B]
    next_block: torch.Tensor  # [B, S]: [first_token, drafts...] at positions P..P+S-1
    k: torch.Tensor  # [L, B, P, Hkv, D] target cache rows 0..P-1
    v: torch.Tensor
    ctx_k: torch.Tensor  # [Ld, B, P, Hkv, D] draft-context rows 0..P-1
    ctx_v: torch.Tensor


class StepOutput(NamedTuple):
    target_tokens: torch.Tensor  # [B, S]: the target's choice at every slot; emit slots 0..accept_len
    accept_len: torch.Tensor  # [B]
    next_block: torch.Tensor  # [B, S] at positions next_start..
    next_start: torch.Tensor  # [B] = start + accept_len + 1
    k: torch.Tensor  # [L, B, S, Hkv, D] target cache rows start..start+S-1
    v: torch.Tensor
    ctx_k: torch.Tensor  # [Ld, B, S, Hkv, D] draft-context rows start..start+S-1
    ctx_v: torch.Tensor


class DecodeOutput(NamedTuple):
    next_token: torch.Tensor  # [B]
    k: torch.Tensor  # [L, B, 1, Hkv, D] target cache row at `position`
    v: torch.Tensor


class DFlashGraphs(nn.Module):
    """Target + drafter; the three graph bodies are methods, wrapped as modules for export below."""

    def __init__(self, target: TargetNetwork, drafter: DrafterNetwork, block_size: int) -> None:
        super().__init__()
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.mask_token_id = drafter.config.mask_token_id

    def draft_block(
        self, first_token: torch.Tensor, start: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor
    ) -> torch.Tensor:
        """first_token, start: [B]; ctx_k/v: [Ld, B, T, Hkv, D] position-indexed, rows < start visible -> block [B, S]."""
        offsets = torch.arange(self.block_size, device=start.device)
        masks = torch.full_like(offsets, self.mask_token_id)[None, :].expand(start.shape[0], -1)
        block = torch.cat([first_token[:, None], masks[:, 1:]], dim=1)  # [B, S]
        embeds = self.target.embed_tokens(block) * self.drafter.config.input_embedding_scale  # the target's table
        hidden = self.drafter(embeds.to(ctx_k.dtype), start[:, None] + offsets, ctx_k, ctx_v, start)
        logits = draft_logits(hidden[:, 1:], self.target.lm_head.weight.to(hidden.dtype), self.drafter.config)
        return torch.cat([first_token[:, None], logits.argmax(dim=-1)], dim=1)  # slot j predicts the token at slot j

    def prefill(
        self,
        input_ids: torch.Tensor,
        uniforms: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        candidate_slots: torch.Tensor,
    ) -> PrefillOutput:
        """input_ids: [B, P] (positions 0..P-1), uniforms: [B, 1]."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None, :].expand(batch, -1)  # [B, P]
        empty_k, empty_v = self._empty_target_cache(batch, input_ids.device)
        out = self.target(input_ids, positions, empty_k, empty_v, logits_to_keep=1)
        first = sample_tokens(out.logits, uniforms, temperature, top_k, top_p, candidate_slots)[:, 0]  # [B]
        ctx_k, ctx_v = self.drafter.context_kv(out.taps, positions)  # [Ld, B, P, Hkv, D]
        start = torch.full_like(first, length)
        return PrefillOutput(first, self.draft_block(first, start, ctx_k, ctx_v), out.k, out.v, ctx_k, ctx_v)

    def step(
        self,
        block: torch.Tensor,
        start: torch.Tensor,
        uniforms: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        candidate_slots: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        past_ctx_k: torch.Tensor,
        past_ctx_v: torch.Tensor,
    ) -> StepOutput:
        """block: [B, S] at positions start..start+S-1; uniforms: [B, S]; past_*: [L, B, T, Hkv, D] with T >= start."""
        positions = start[:, None] + torch.arange(block.shape[1], device=block.device)  # [B, S]
        out = self.target(block, positions, past_k, past_v)  # verify: logits [B, S, V]
        target_tokens = sample_tokens(out.logits, uniforms, temperature, top_k, top_p, candidate_slots)
        accept_len = accepted_prefix_length(block[:, 1:], target_tokens)  # [B]
        # Tap every slot; rows past the accepted ones are invisible (>= next_start) and get overwritten later.
        ctx_k, ctx_v = self.drafter.context_kv(out.taps, positions)  # [Ld, B, S, Hkv, D]
        next_start = start + accept_len + 1
        bonus = target_tokens.gather(1, accept_len[:, None])[:, 0]  # [B]
        next_block = self.draft_block(
            bonus, next_start, write_rows(past_ctx_k, ctx_k, positions), write_rows(past_ctx_v, ctx_v, positions)
        )
        return StepOutput(target_tokens, accept_len, next_block, next_start, out.k, out.v, ctx_k, ctx_v)

    def decode(
        self,
        token: torch.Tensor,
        position: torch.Tensor,
        uniforms: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        candidate_slots: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> DecodeOutput:
        """token, position: [B]; uniforms: [B, 1]; past_k/v: [L, B, T, Hkv, D] with T >= position."""
        out = self.target(token[:, None], position[:, None], past_k, past_v)
        next_token = sample_tokens(out.logits, uniforms, temperature, top_k, top_p, candidate_slots)[:, 0]
        return DecodeOutput(next_token, out.k, out.v)

    def _empty_target_cache(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.target.config
        empty = torch.zeros(
            c.num_layers, batch, 0, c.num_kv_heads, c.head_dim, dtype=self.target.embed_tokens.weight.dtype, device=device
        )
        return empty, empty


class PrefillGraph(DFlashGraphs):
    """Export entry: forward is `prefill` (its parameter names become the ONNX input names)."""

    forward = DFlashGraphs.prefill


class StepGraph(DFlashGraphs):
    forward = DFlashGraphs.step


class DecodeGraph(DFlashGraphs):
    forward = DFlashGraphs.decode


GRAPHS: dict[str, tuple[type[DFlashGraphs], type[tuple]]] = {
    "prefill": (PrefillGraph, PrefillOutput),
    "step": (StepGraph, StepOutput),
    "decode": (DecodeGraph, DecodeOutput),
}


def graph_inputs(name: str) -> tuple[str, ...]:
    """Input names of a graph: the parameters of its DFlashGraphs method."""
    return tuple(inspect.signature(getattr(DFlashGraphs, name)).parameters)[1:]  # without self


def graph_outputs(name: str) -> tuple[str, ...]:
    return tuple(GRAPHS[name][1]._fields)  # type: ignore[attr-defined]


def graph_module(graphs: DFlashGraphs, name: str) -> DFlashGraphs:
    """The same target and drafter behind one graph's forward, for export."""
    return GRAPHS[name][0](graphs.target, graphs.drafter, graphs.block_size).eval()
