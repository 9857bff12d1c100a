"""Engines: a runner executes the fused graphs (torch modules, ONNX Runtime sessions, TensorRT plans);
`GraphEngine` owns the static caches around it and is what the host loop calls.

Per call the engine passes each cache's first T rows (T = largest start in the batch) and writes the rows
the graph returns at their positions. The host loop never touches tensors beyond the emitted tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from dflash_trt.builder.graphs import DecodeOutput, DFlashGraphs, PrefillOutput, StepOutput
from dflash_trt.builder.networks import DrafterNetwork, KVCache, TargetNetwork
from dflash_trt.runtime.sampling import SamplingParams, SamplingTensors


@dataclass(frozen=True)
class EngineSpec:
    """What the host needs to know about a built pair (stored in the engine manifest)."""

    block_size: int
    max_seq_len: int
    vocab_size: int
    mask_token_id: int
    target_layers: int
    target_kv_heads: int
    target_head_dim: int
    draft_layers: int
    draft_kv_heads: int
    draft_head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    @staticmethod
    def of(target: TargetNetwork, drafter: DrafterNetwork, block_size: int, max_seq_len: int) -> EngineSpec:
        t, d = target.config, drafter.config
        return EngineSpec(
            block_size, max_seq_len, t.vocab_size, d.mask_token_id, t.num_layers, t.num_kv_heads, t.head_dim,
            d.num_layers, d.num_kv_heads, d.head_dim, str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        )  # fmt: skip

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @property
    def cache_slots(self) -> int:
        """A verify block may write up to block_size - 1 rows past the last emitted position."""
        return self.max_seq_len + self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.dtype]


class GraphRunner(Protocol):
    """Executes the three graphs of a built pair; inputs and outputs as in builder.graphs."""

    def prefill(self, *inputs: torch.Tensor) -> PrefillOutput: ...

    def step(self, *inputs: torch.Tensor) -> StepOutput: ...

    def decode(self, *inputs: torch.Tensor) -> DecodeOutput: ...


class TorchRunner:
    """The reference: the graph modules run eagerly."""

    def __init__(self, graphs: DFlashGraphs) -> None:
        self.graphs = graphs.eval()

    @torch.inference_mode()
    def prefill(self, *inputs: torch.Tensor) -> PrefillOutput:
        return self.graphs.prefill(*inputs)

    @torch.inference_mode()
    def step(self, *inputs: torch.Tensor) -> StepOutput:
        return self.graphs.step(*inputs)

    @torch.inference_mode()
    def decode(self, *inputs: torch.Tensor) -> DecodeOutput:
        return self.graphs.decode(*inputs)


@dataclass
class SequenceCaches:
    target: KVCache  # [L, B, slots, Hkv, D]
    draft_ctx: KVCache  # [Ld, B, slots, Hkv, D]


@dataclass(frozen=True)
class StepResult:
    emitted: torch.Tensor  # [B, S]: slots 0..accept_len hold the tokens to emit
    accept_len: torch.Tensor  # [B]: accepted draft tokens (emitted = accept_len + 1)
    next_block: torch.Tensor  # [B, S]: [last emitted token, draft tokens...]
    next_start: torch.Tensor  # [B]: position of next_block[:, 0]


class GraphEngine:
    """Static caches + a graph runner: the fused prefill / step / plain decode calls of the host loop."""

    def __init__(self, runner: GraphRunner, spec: EngineSpec) -> None:
        if spec.block_size < 2:
            raise ValueError(f"block_size={spec.block_size} must be at least 2 (the last token plus one draft slot)")
        self.runner, self.spec = runner, spec
        self.block_size, self.max_seq_len, self.vocab_size = spec.block_size, spec.max_seq_len, spec.vocab_size

    def allocate(self, batch: int = 1) -> SequenceCaches:
        s = self.spec
        target = KVCache.allocate(s.target_layers, batch, s.cache_slots, s.target_kv_heads, s.target_head_dim, s.torch_dtype)
        draft = KVCache.allocate(s.draft_layers, batch, s.cache_slots, s.draft_kv_heads, s.draft_head_dim, s.torch_dtype)
        return SequenceCaches(target, draft)

    def _sampling(self, sampling: SamplingParams, batch: int) -> tuple[torch.Tensor, ...]:
        t = SamplingTensors.of([sampling] * batch, self.vocab_size)
        return t.temperature, t.top_k, t.top_p, t.candidate_slots

    def prefill(
        self, caches: SequenceCaches, prompt: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams
    ) -> StepResult:
        """prompt: [B, P], uniforms: [B, 1] -> the first token (emitted[:, 0]) and the first draft block."""
        batch, length = prompt.shape
        out = self.runner.prefill(prompt, uniforms.float(), *self._sampling(sampling, batch))
        positions = torch.arange(length).expand(batch, -1)
        caches.target.write(positions, out.k, out.v)
        caches.draft_ctx.write(positions, out.ctx_k, out.ctx_v)
        start = torch.full((batch,), length, dtype=torch.long)
        return StepResult(out.first_token[:, None], torch.zeros(batch, dtype=torch.long), out.next_block, start)

    def step(
        self, caches: SequenceCaches, block: torch.Tensor, start: torch.Tensor, uniforms: torch.Tensor, sampling: SamplingParams
    ) -> StepResult:
        """block: [B, S] at positions start..start+S-1, uniforms: [B, S] -> accepted tokens and the next block."""
        rows = int(start.max())  # rows at or past a sequence's start are stale: pass only what can be visible
        past_k, past_v = caches.target.past(rows)
        past_ctx_k, past_ctx_v = caches.draft_ctx.past(rows)
        out = self.runner.step(
            block, start, uniforms.float(), *self._sampling(sampling, block.shape[0]), past_k, past_v, past_ctx_k, past_ctx_v
        )
        positions = start[:, None] + torch.arange(block.shape[1])
        caches.target.write(positions, out.k, out.v)
        caches.draft_ctx.write(positions, out.ctx_k, out.ctx_v)
        return StepResult(out.target_tokens, out.accept_len, out.next_block, out.next_start)

    def decode_one(
        self,
        caches: SequenceCaches,
        token: torch.Tensor,
        position: torch.Tensor,
        uniforms: torch.Tensor,
        sampling: SamplingParams,
    ) -> torch.Tensor:
        """Plain decoding step (the baseline): token, position: [B] -> next token [B]."""
        past_k, past_v = caches.target.past(int(position.max()))
        out = self.runner.decode(token, position, uniforms.float(), *self._sampling(sampling, token.shape[0]), past_k, past_v)
        caches.target.write(position[:, None], out.k, out.v)
        return out.next_token


def torch_engine(target: TargetNetwork, drafter: DrafterNetwork, max_seq_len: int, block_size: int | None = None) -> GraphEngine:
    """The torch reference engine for a loaded pair."""
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
    spec = EngineSpec.of(target, drafter, size, max_seq_len)
    return GraphEngine(TorchRunner(DFlashGraphs(target, drafter, size)), spec)
