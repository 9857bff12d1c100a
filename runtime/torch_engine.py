"""The torch reference engine: fused prefill and step on the torch networks, one static cache per sequence.

prefill: prompt -> target (logits, taps) -> first token -> tap the prompt into the draft context -> first draft block
step:    verify the block with the target -> accept -> tap the accepted positions -> draft the next block

Compiled engines (ONNX Runtime, TensorRT) implement the same two functions; the host loop only calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from dflash_trt.builder.networks import DrafterNetwork, KVCache, TargetNetwork, draft_logits
from dflash_trt.runtime.sampling import SamplingParams, accepted_prefix_length, sample_tokens


@dataclass
class SequenceCaches:
    target: KVCache  # [L_target, B, T, Hkv, D]
    draft_ctx: KVCache  # [L_draft, B, T, Hkv, D]


@dataclass(frozen=True)
class StepResult:
    emitted: torch.Tensor  # [B, S]: slots 0..accept_len hold the tokens to emit
    accept_len: torch.Tensor  # [B]: accepted draft tokens (emitted = accept_len + 1)
    next_block: torch.Tensor  # [B, S]: [last emitted token, draft tokens...]
    next_start: torch.Tensor  # [B]: position of next_block[:, 0]


class TorchDFlashEngine:
    """Target + drafter as torch modules, exposing the fused prefill/step the compiled engines also provide."""

    def __init__(self, target: TargetNetwork, drafter: DrafterNetwork, max_seq_len: int, block_size: int | None = None) -> None:
        if tuple(target.tap_layer_ids) != tuple(drafter.config.target_layer_ids):
            raise ValueError(
                f"target taps {target.tap_layer_ids} != drafter target_layer_ids {drafter.config.target_layer_ids}; "
                "load the target with tap_layer_ids=drafter.config.target_layer_ids"
            )
        self.target, self.drafter = target, drafter
        self.block_size = block_size or drafter.config.block_size
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be at least 2 (the last token plus one draft slot)")
        if not 0 < max_seq_len <= target.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len={max_seq_len} must be in [1, {target.config.max_position_embeddings}] "
                "(the target's max_position_embeddings)"
            )
        self.max_seq_len = max_seq_len
        self.vocab_size = target.config.vocab_size
        self.mask_token_id = drafter.config.mask_token_id

    @property
    def cache_slots(self) -> int:
        """A verify block may write up to block_size - 1 rows past the last emitted position."""
        return self.max_seq_len + self.block_size

    def allocate(self, batch: int = 1) -> SequenceCaches:
        return SequenceCaches(
            self.target.allocate_cache(batch, self.cache_slots), self.drafter.allocate_cache(batch, self.cache_slots)
        )

    def _draft_block(self, caches: SequenceCaches, first_token: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """first_token: [B], start: [B] (its position; context = positions < start) -> block [B, S]."""
        batch, size = first_token.shape[0], self.block_size
        block = torch.full((batch, size), self.mask_token_id, dtype=torch.long)
        block[:, 0] = first_token
        positions = start[:, None] + torch.arange(size)  # [B, S]
        embeds = self.target.embed_tokens(block) * self.drafter.config.input_embedding_scale  # target's table
        rows = int(start.max())  # only committed context rows can be visible
        ctx = caches.draft_ctx
        hidden = self.drafter(embeds.to(self.drafter.fc.weight.dtype), positions, ctx.k[:, :, :rows], ctx.v[:, :, :rows], start)
        logits = draft_logits(hidden[:, 1:], self.target.lm_head.weight.to(hidden.dtype), self.drafter.config)
        block[:, 1:] = logits.argmax(dim=-1)  # slot j predicts the token at slot j; slot 0 is discarded
        return block

    def _tap(self, caches: SequenceCaches, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the draft-context K/V of these positions (taps: [B, S, n*E], positions: [B, S])."""
        ctx_k, ctx_v = self.drafter.context_kv(taps, positions)
        caches.draft_ctx.write(positions, ctx_k, ctx_v)

    @torch.inference_mode()
    def prefill(
        self, caches: SequenceCaches, prompt: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams
    ) -> StepResult:
        """prompt: [B, P], uniforms: [B, 1] -> the first token (emitted[:, 0]) and the first draft block."""
        batch, length = prompt.shape
        positions = torch.arange(length).expand(batch, -1)  # [B, P]
        logits, taps = self.target(prompt, positions, caches.target, logits_to_keep=1)
        first = sample_tokens(logits, uniforms, sampling)[:, 0]  # [B]
        self._tap(caches, taps, positions)
        start = torch.full((batch,), length, dtype=torch.long)
        block = self._draft_block(caches, first, start)
        return StepResult(first[:, None], torch.zeros(batch, dtype=torch.long), block, start)

    @torch.inference_mode()
    def step(
        self, caches: SequenceCaches, block: torch.Tensor, start: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams
    ) -> StepResult:
        """block: [B, S] at positions start..start+S-1, uniforms: [B, S] -> accepted tokens and the next block."""
        positions = start[:, None] + torch.arange(block.shape[1])  # [B, S]
        logits, taps = self.target(block, positions, caches.target)  # verify: [B, S, V]
        target_tokens = sample_tokens(logits, uniforms, sampling)  # the target's own choice at every slot
        accept_len = accepted_prefix_length(block[:, 1:], target_tokens)  # [B]
        # Tap all slots; rows past the accepted ones are stale and get overwritten by the next verify.
        self._tap(caches, taps, positions)
        next_start = start + accept_len + 1
        bonus = target_tokens.gather(1, accept_len[:, None])[:, 0]  # [B]
        next_block = self._draft_block(caches, bonus, next_start)
        return StepResult(target_tokens, accept_len, next_block, next_start)

    @torch.inference_mode()
    def decode_one(
        self,
        caches: SequenceCaches,
        token: torch.Tensor,
        position: torch.Tensor,
        uniforms: torch.Tensor,
        sampling: SamplingParams,
    ) -> torch.Tensor:
        """Plain decoding step (the baseline): token, position: [B] -> next token [B]."""
        logits, _ = self.target(token[:, None], position[:, None], caches.target)
        return sample_tokens(logits, uniforms, sampling)[:, 0]
