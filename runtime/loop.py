"""The host side of the draft-verify loop: validate, prefill, call step until done, stop, count.

The engine does all tensor work (fused prefill and step); per step the host only slices out the emitted
tokens, checks stop conditions on them, and updates counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from dflash_trt.runtime.engine import GraphEngine, SequenceCaches, StepResult
from dflash_trt.runtime.sampling import RequestError, SamplingParams


@dataclass(frozen=True)
class StopCriteria:
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # needed for stop strings

    def validate(self) -> None:
        if self.stop_strings and self.decode is None:
            raise RequestError("stop strings need a tokenizer to decode with; pass StopCriteria(decode=tokenizer.decode)")
        if any(s == "" for s in self.stop_strings):
            raise RequestError("an empty stop string would stop at once; remove it")

    def first_stop(self, tokens: list[int], new_from: int) -> int | None:
        """Index one past the token that ends generation, looking at tokens[new_from:], else None."""
        for index in range(new_from, len(tokens)):
            if tokens[index] in self.eos_token_ids:
                return index + 1
            if self.stop_strings and self.decode is not None:
                text = self.decode(tokens[: index + 1])
                if any(stop in text for stop in self.stop_strings):
                    return index + 1
        return None


NO_STOP = StopCriteria()
GREEDY = SamplingParams()


@dataclass
class GenerationStats:
    block_size: int
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per step (accepted + bonus)
    position_accept_counts: list[int] = field(default_factory=list)  # [S-1]: steps whose draft slot j+1 was accepted
    finish_reason: str = "length"  # "length" | "stop"

    def record_step(self, accept_len: int, emitted: int) -> None:
        self.steps += 1
        self.acceptance_lengths.append(emitted)
        for slot in range(accept_len):
            self.position_accept_counts[slot] += 1

    @property
    def draft_tokens(self) -> int:
        return self.steps * (self.block_size - 1)

    @property
    def accepted_draft_tokens(self) -> int:
        return sum(self.position_accept_counts)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per step, bonus included: in [1, block_size]."""
        return sum(self.acceptance_lengths) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.steps else 0.0


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats


def validate_request(prompt_ids: Sequence[int], max_new_tokens: int, engine: GraphEngine, sampling: SamplingParams) -> None:
    if len(prompt_ids) == 0:
        raise RequestError("the prompt is empty: pass at least one token (e.g. the BOS token or a chat-templated prompt)")
    bad_ids = [t for t in prompt_ids if not 0 <= t < engine.vocab_size]
    if bad_ids:
        raise RequestError(
            f"prompt token ids {bad_ids[:5]} are outside the vocabulary [0, {engine.vocab_size}): "
            "tokenize with the target's tokenizer"
        )
    max_seq_len = engine.max_seq_len
    if max_new_tokens <= 0:
        raise RequestError(f"max_tokens={max_new_tokens} must be positive")
    if len(prompt_ids) + max_new_tokens > max_seq_len:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new_tokens}) = {len(prompt_ids) + max_new_tokens} "
            f"exceeds the maximum sequence length {max_seq_len}: shorten the prompt, lower max_tokens, or rebuild "
            "with a larger --max-seq-len"
        )
    sampling.validate()


def _uniforms(rng: np.random.Generator, count: int) -> torch.Tensor:
    return torch.from_numpy(rng.random((1, count)))  # [1, count] in [0, 1)


@dataclass
class _Started:
    caches: SequenceCaches
    rng: np.random.Generator
    first: StepResult
    tokens: list[int]


def _start(
    engine: GraphEngine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop: StopCriteria,
    stats: GenerationStats,
) -> _Started:
    """Validate the request, allocate its caches and prefill: the first token and the first draft block."""
    validate_request(prompt_ids, max_new_tokens, engine, sampling)
    stop.validate()
    rng = sampling.uniform_source()
    caches = engine.allocate(1)
    began = time.perf_counter()
    first = engine.prefill(caches, torch.tensor([list(prompt_ids)]), _uniforms(rng, 1), sampling)
    stats.prefill_seconds = time.perf_counter() - began
    tokens = [int(first.emitted[0, 0])]
    if stop.first_stop(tokens, 0) is not None:
        stats.finish_reason = "stop"
    return _Started(caches, rng, first, tokens)


def stream_dflash(
    engine: GraphEngine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop: StopCriteria = NO_STOP,
    stats: GenerationStats | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens of each step as soon as they are accepted (several per step when drafts are accepted)."""
    stats = stats if stats is not None else GenerationStats(engine.block_size)
    stats.position_accept_counts = [0] * (engine.block_size - 1)
    started = _start(engine, prompt_ids, max_new_tokens, sampling, stop, stats)
    tokens, out = started.tokens, started.first
    yield tokens[:]
    decode_began = time.perf_counter()
    while stats.finish_reason != "stop" and len(tokens) < max_new_tokens:
        # Step: verify the block, accept a prefix plus the bonus token, draft the next block.
        out = engine.step(started.caches, out.next_block, out.next_start, _uniforms(started.rng, engine.block_size), sampling)
        accept_len = int(out.accept_len[0])
        before = len(tokens)
        tokens.extend(out.emitted[0, : accept_len + 1].tolist()[: max_new_tokens - before])
        end = stop.first_stop(tokens, before)
        if end is not None:
            del tokens[end:]
            stats.finish_reason = "stop"
        stats.record_step(accept_len, len(tokens) - before)
        stats.decode_seconds = time.perf_counter() - decode_began
        yield tokens[before:]


def generate(
    engine: GraphEngine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop: StopCriteria = NO_STOP,
) -> Generation:
    """DFlash speculative decoding of one prompt: the generated tokens (prompt excluded) and statistics."""
    stats = GenerationStats(engine.block_size)
    tokens = [token for piece in stream_dflash(engine, prompt_ids, max_new_tokens, sampling, stop, stats) for token in piece]
    return Generation(tokens, stats)


def generate_plain(
    engine: GraphEngine,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop: StopCriteria = NO_STOP,
) -> Generation:
    """Plain autoregressive decoding on the same engine (the baseline DFlash must equal at T=0)."""
    stats = GenerationStats(1)
    started = _start(engine, prompt_ids, max_new_tokens, sampling, stop, stats)
    tokens = started.tokens
    decode_began = time.perf_counter()
    while stats.finish_reason != "stop" and len(tokens) < max_new_tokens:
        position = torch.tensor([len(prompt_ids) + len(tokens) - 1])
        token = engine.decode_one(started.caches, torch.tensor(tokens[-1:]), position, _uniforms(started.rng, 1), sampling)
        tokens.append(int(token[0]))
        stats.record_step(0, 1)
        if stop.first_stop(tokens, len(tokens) - 1) is not None:
            stats.finish_reason = "stop"
    stats.decode_seconds = time.perf_counter() - decode_began
    return Generation(tokens, stats)
