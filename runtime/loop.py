"""One sequence's side of the draft-verify loop: validate it, commit each step's tokens, stop, count.

The engine does all tensor work (fused prefill and step) for a whole batch; `Sequence.commit` is what the host
does per sequence and step: take the accepted tokens, check stop conditions on them, update counters, keep the
next block. `generate` and `stream_dflash` run one sequence through the batch scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from dflash_trt.runtime.lookup import NgramIndex
from dflash_trt.runtime.sampling import RequestError, SamplingParams

if TYPE_CHECKING:
    from dflash_trt.runtime.engine import GraphEngine
    from dflash_trt.runtime.scheduler import VerifyPolicy

STOP_WINDOW_TOKENS = 8  # tokens decoded beyond the longest stop string's length, when looking for it


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
        """Index one past the token that ends generation, looking at tokens[new_from:], else None.

        A stop string is looked for in the text of a tail window only (4 tokens per character of the longest
        stop string, as a character takes at most 4 byte-level tokens, plus STOP_WINDOW_TOKENS), so the check
        costs the same at every length.
        """
        window = 4 * max((len(s) for s in self.stop_strings), default=0) + STOP_WINDOW_TOKENS
        for index in range(new_from, len(tokens)):
            if tokens[index] in self.eos_token_ids:
                return index + 1
            if self.stop_strings and self.decode is not None:
                text = self.decode(tokens[max(0, index + 1 - window) : index + 1])
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
    reused_prompt_tokens: int = 0  # prompt tokens whose rows came from an earlier prompt's prefill (not computed)
    decode_seconds: float = 0.0
    draft_tokens: int = 0  # drafts the target verified
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per step (accepted + bonus)
    position_accept_counts: list[int] = field(default_factory=list)  # [S-1]: steps whose draft slot j+1 was accepted
    position_reached_counts: list[int] = field(default_factory=list)  # [S-1]: steps that verified slot j+1, slots before accepted
    lookup_tokens: int = 0  # lookup drafts the target verified (`runtime.lookup`; not in the counts above)
    lookup_accepted: int = 0  # of those, accepted
    lookup_in_blocks: int = 0  # drafting steps' block slots that held lookup drafts (in `draft_tokens` and the counts)
    finish_reason: str = "length"  # "length" | "stop" | "cancelled"

    def __post_init__(self) -> None:
        if not self.position_accept_counts:
            self.position_accept_counts = [0] * (self.block_size - 1)
        if not self.position_reached_counts:
            self.position_reached_counts = [0] * (self.block_size - 1)

    def record_step(self, verified: int, accept_len: int, emitted: int, lookup: bool = False) -> None:
        """A step that verified `verified` drafts of the drafter, or with `lookup` that many lookup drafts (a row's
        padding among them: a guess like any other)."""
        self.steps += 1
        self.acceptance_lengths.append(emitted)
        if lookup:
            self.lookup_tokens += verified
            self.lookup_accepted += accept_len
            return
        self.draft_tokens += verified
        for slot in range(accept_len):
            self.position_accept_counts[slot] += 1
        for slot in range(min(accept_len + 1, verified)):  # the first rejected draft was reached too
            self.position_reached_counts[slot] += 1

    @property
    def accepted_draft_tokens(self) -> int:
        return sum(self.position_accept_counts)

    @property
    def verified_drafts(self) -> int:
        """Drafts of both kinds the target verified: the drafter's and lookup drafts."""
        return self.draft_tokens + self.lookup_tokens

    @property
    def accepted_drafts(self) -> int:
        """Of `verified_drafts`, accepted."""
        return self.accepted_draft_tokens + self.lookup_accepted

    @property
    def tau(self) -> float:
        """Mean tokens emitted per step, bonus included: in [1, block_size]."""
        return sum(self.acceptance_lengths) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats


def validate_request(prompt_ids: Tokens[int], max_new_tokens: int, engine: GraphEngine, sampling: SamplingParams) -> None:
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


@dataclass
class Sequence:
    """One request in the engine: its slot, its tokens so far, its next block and its counters."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    stop: StopCriteria = NO_STOP
    stats: GenerationStats = field(default_factory=lambda: GenerationStats(2))
    prefix_scope: Hashable = None  # reuses rows only of prompts of the same scope (`GraphEngine.acquire`)
    tokens: list[int] = field(default_factory=list)  # generated so far
    slot: int = -1
    prefill_end: int = 0  # prompt tokens whose rows its slot holds (a prompt may be prefilled in chunks)
    context_end: int = 0  # its slot holds every state's rows (the drafter's context too) of the positions before this
    block: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [last token, drafts...]
    lookup: NgramIndex = field(default_factory=NgramIndex)  # prompt and tokens so far, for lookup drafts
    start: int = 0  # position of block[0]
    uniforms: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # one per generated token
    finished: bool = False
    began: float = field(default_factory=time.perf_counter)

    def validate(self, engine: GraphEngine) -> None:
        validate_request(self.prompt, self.max_new_tokens, engine, self.sampling)
        self.stop.validate()
        self.uniforms = self.sampling.uniforms(self.max_new_tokens + engine.block_size)
        self.lookup.feed(self.prompt)

    @property
    def prefilled(self) -> bool:
        """Its whole prompt is in its slot: it has its first token and generates."""
        return self.prefill_end == len(self.prompt)

    @property
    def catch_up_tokens(self) -> int:
        """Tokens a catch-up recomputes before it drafts again: those since its drafter context ends, through its next
        block's first (0: the context is current)."""
        return self.start - self.context_end + 1 if self.context_end < self.start else 0

    @property
    def drafts(self) -> int:
        """Drafted tokens in the next block that a step can verify."""
        return len(self.block) - 1

    def commit(
        self,
        emitted: list[int],
        accept_len: int,
        verified: int,
        next_block: np.ndarray,
        next_start: int,
        lookup: bool = False,
    ) -> list[int]:
        """Take one step's tokens (the accepted drafts and the bonus token): returns what to send, sets `finished`.
        `lookup`: the `verified` drafts were lookup drafts, not the drafter's."""
        before = len(self.tokens)
        self.tokens.extend(emitted[: self.max_new_tokens - before])
        end = self.stop.first_stop(self.tokens, before)
        if end is not None:
            del self.tokens[end:]
            self.stats.finish_reason = "stop"
        self.lookup.feed(self.tokens[before:])
        if before:  # the prefill's first token is not a step
            self.stats.record_step(verified, accept_len, len(self.tokens) - before, lookup)
            self.stats.decode_seconds = time.perf_counter() - self.began
        else:
            self.stats.prefill_seconds = time.perf_counter() - self.began
            self.began = time.perf_counter()
        self.finished = end is not None or len(self.tokens) >= self.max_new_tokens
        self.block, self.start = next_block, next_start
        return self.tokens[before:]


def stream_dflash(
    engine: GraphEngine,
    prompt_ids: Tokens[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop: StopCriteria = NO_STOP,
    stats: GenerationStats | None = None,
    policy: VerifyPolicy | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens of each step as soon as they are accepted (several per step when drafts are accepted)."""
    from dflash_trt.runtime.scheduler import Scheduler

    sequence = Sequence(list(prompt_ids), max_new_tokens, sampling, stop, stats or GenerationStats(engine.block_size))
    scheduler = Scheduler(engine, policy)
    scheduler.submit(sequence)
    while not sequence.finished:
        for _, tokens in scheduler.step():
            yield tokens


def generate(
    engine: GraphEngine,
    prompt_ids: Tokens[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop: StopCriteria = NO_STOP,
    policy: VerifyPolicy | None = None,
) -> Generation:
    """DFlash speculative decoding of one prompt: the generated tokens (prompt excluded) and statistics."""
    stats = GenerationStats(engine.block_size)
    tokens = [t for piece in stream_dflash(engine, prompt_ids, max_new_tokens, sampling, stop, stats, policy) for t in piece]
    return Generation(tokens, stats)


def generate_plain(
    engine: GraphEngine,
    prompt_ids: Tokens[int],
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    stop: StopCriteria = NO_STOP,
) -> Generation:
    """Plain autoregressive decoding on the same engine (the baseline DFlash must equal at T=0)."""
    from dflash_trt.runtime.scheduler import PlainDecoding

    return generate(engine, prompt_ids, max_new_tokens, sampling, stop, PlainDecoding())
