"""Throughput under load, in process: C closed-loop clients on one engine's scheduler (each sends its next prompt
as soon as its previous answer is complete), measured for three ways of serving them on the same engine:

- `dflash`: in-flight batching, verify length chosen by load (AdaptiveVerify);
- `one-at-a-time`: the same DFlash, one request in the engine at a time (what the server did before batching);
- `plain`: in-flight batching of plain decoding (the decode graph, no drafts).

Each client sends about `requests_per_client` requests, in whole passes over the prompts (`requests_at`): with as
many requests as clients, every client's last request ends in a batch that has drained (session 21, C = 16 and 20
HumanEval prompts: the last 4 ran 128 steps at batch 4, and the table read 3.04x one at a time where a full batch
reads 3.47x), so that measured how a batch empties, not throughput at C.

Every request of a prompt asks for as many tokens: `max_tokens`, or with a length spread (`LoadSettings`) the
prompt's own share of it. With one length for all, plain decoding's clients finish on one step and are readmitted
together, and its batch runs in waves: a call reads every row's past up to the batch's longest (`GraphEngine.run`),
in a wave the longest prompt plus the wave's age, where DFlash's rows, which finish at different steps, are nearly
always led by one close to its end (session 52, the demo pair, 2 threads: a `decode` call of 64 rows all at
position 280 took 323 ms, of 64 rows at 150-345, mean 250, 371 ms; in a C = 64 load, `decode` calls of 64 rows
took 348 ms on average in DFlash's batch against 330 ms in plain decoding's).

Reports aggregate generated tok/s, p50/p99 time to first token and inter-token latency (gap between a client's
successive tokens, a step's tokens spread evenly over the step), and the share of each step spent on the host.
At each level DFlash and plain decoding run side by side in lock step (`run_load`): each its own scheduler on its
own slots of the engine, their steps taken in turn, each timed on its own clock (its own steps' seconds: TTFT and
inter-token gaps too). Back-to-back runs could not tell them apart on a CPU whose speed drifts by up to 18% from one
minute to the next; in lock step the drift weighs on both alike. One at a time runs beside each level, over the
level's request count, taking turns with the level's pair in slices of about `SLICE_SECONDS` of steps (`take_turns`:
the side behind in its share of requests finished goes next), so both span the same minutes: run before the levels,
it read 37.4 and 42.8 tok/s in two rounds of one session 26 run. Not in lock step: stepping batch-1 steps in turn
with batch-16 steps slowed them by about 10% (session 25). Rounds are pooled (tokens and seconds added).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dflash_trt.runtime.engine import GraphEngine
from dflash_trt.runtime.loop import Sequence
from dflash_trt.runtime.scheduler import LOOKUP_LIMIT, AdaptiveVerify, PlainDecoding, Scheduler, VerifyPolicy

REQUESTS_PER_CLIENT = 4  # requests each client sends in a run, about (`requests_at`)
SLICE_SECONDS = 5.0  # one at a time and a level's pair take turns in slices of about this much stepping


@dataclass(frozen=True)
class LoadSettings:
    """How every scheduler of a load run serves and what its requests ask: `prefill_chunk` prompt tokens prefilled per
    step while others generate (`Scheduler`; 0: whole prompts); DFlash and one at a time verify lookup drafts of up to
    `lookup_drafts` tokens (`policy_for`); `length_spread`: each prompt's requests ask for max_tokens x a factor of its
    own, spread evenly over [1 - spread, 1 + spread] (`lengths`; 0: every request max_tokens)."""

    prefill_chunk: int = 0
    lookup_drafts: int = LOOKUP_LIMIT
    length_spread: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.length_spread < 1.0:
            raise ValueError(f"length_spread={self.length_spread}: give a share in [0, 1), e.g. 0.5 for 0.5x-1.5x max_tokens")

    def lengths(self, max_tokens: int, prompts: int) -> list[int]:
        """Each prompt's max_tokens, the same in every request of it (so its outputs compare across requests and
        modes): the factors evenly spaced over [1 - spread, 1 + spread], their mean 1, handed out to the prompts in a
        fixed shuffled order (a prompt's length says nothing of its answer's). Why spread them: the module docstring."""
        if prompts == 1 or not self.length_spread:
            return [max_tokens] * prompts
        rank = np.random.default_rng(0).permutation(prompts)  # [P]: each prompt's place among the factors
        factors = 1.0 - self.length_spread + 2.0 * self.length_spread * rank / (prompts - 1)
        return [max(1, round(max_tokens * float(factor))) for factor in factors]


@dataclass
class LoadResult:
    mode: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    ttfts: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # scheduler.step() wall time, prefills excluded
    graph_seconds: list[float] = field(default_factory=list)  # of which the batched graph call
    widths: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # of finished requests
    reused_prompt_tokens: int = 0  # of which rows came from an earlier prompt (a shared prefix, `GraphEngine.acquire`)
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt number -> tokens (its first request's)
    consistent: bool = True  # every request of a prompt, in every pooled round, gave the same tokens

    def record(self, prompt_number: int, tokens: list[int]) -> None:
        """A finished request's output: the first of its prompt kept, any later one checked against it."""
        first = self.outputs.setdefault(prompt_number, tokens)
        self.consistent = self.consistent and first == tokens

    def merged(self, other: LoadResult) -> LoadResult:
        """This round and another of the same mode and load, pooled: counts and times added, samples joined."""
        return LoadResult(
            self.mode,
            self.concurrency,
            self.requests + other.requests,
            self.tokens + other.tokens,
            self.seconds + other.seconds,
            self.ttfts + other.ttfts,
            self.inter_token + other.inter_token,
            self.step_seconds + other.step_seconds,
            self.graph_seconds + other.graph_seconds,
            self.widths + other.widths,
            self.prompt_tokens + other.prompt_tokens,
            self.reused_prompt_tokens + other.reused_prompt_tokens,
            self.outputs,
            self.consistent and other.consistent and self.outputs == other.outputs,
        )

    def summary(self) -> dict[str, Any]:
        host = [s - g for s, g in zip(self.step_seconds, self.graph_seconds, strict=True)]
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "tok_s": self.tokens / self.seconds,
            "ttft_ms_p50": _percentile(self.ttfts, 50) * 1e3,
            "ttft_ms_p99": _percentile(self.ttfts, 99) * 1e3,
            "itl_ms_p50": _percentile(self.inter_token, 50) * 1e3,
            "itl_ms_p99": _percentile(self.inter_token, 99) * 1e3,
            "host_share_of_step": sum(host) / max(sum(self.step_seconds), 1e-9),
            "mean_verify_width": float(np.mean(self.widths)) if self.widths else 0.0,
            "reused_prompt_share": self.reused_prompt_tokens / max(self.prompt_tokens, 1),
        }


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def policy_for(mode: str, engine: GraphEngine, slots: int, lookup_drafts: int = LOOKUP_LIMIT) -> tuple[VerifyPolicy, int]:
    """(verify policy, max active sequences) of a mode whose scheduler gets `slots` of the engine's slots: its
    policy calibrates on that many (the other modes' slots held meanwhile). DFlash and one at a time verify lookup
    drafts of up to `lookup_drafts` tokens (`AdaptiveVerify.lookup_limit`; 0: none)."""
    held = [engine.pool.acquire() for _ in range(max(engine.pool.free_slots - slots, 0))]
    try:
        if mode == "plain":
            plain = PlainDecoding()
            plain.calibrate(engine)  # its shapes planned before the timed window, as the other modes' are
            return plain, slots
        return AdaptiveVerify.calibrated(engine, lookup_drafts), (1 if mode == "one-at-a-time" else slots)
    finally:
        for slot in held:
            engine.pool.release(slot)


_RUNS = itertools.count()  # numbers the closed-loop runs of a process (their prefix scopes)


class _ClosedLoop:
    """One mode's clients: `requests` requests over `concurrency` closed-loop clients on its own scheduler, timed on
    its own clock (the seconds of its own steps), so modes stepping in turn each measure what they would alone."""

    def __init__(
        self,
        engine: GraphEngine,
        prompts: list[list[int]],
        max_tokens: int,
        concurrency: int,
        requests: int,
        mode: str,
        settings: LoadSettings,
    ) -> None:
        self.prompts, self.lengths = prompts, settings.lengths(max_tokens, len(prompts))
        self.result = LoadResult(mode, concurrency, requests, 0, 0.0)
        policy, max_active = policy_for(mode, engine, concurrency, settings.lookup_drafts)
        self.scheduler = Scheduler(engine, policy, max_active, settings.prefill_chunk)
        self.run = next(_RUNS)
        self.pending = deque(range(requests))
        # id(sequence) -> (request number, submit time) and -> time of its last tokens; dropped when it finishes (its
        # id can then be the next request's)
        self.started: dict[int, tuple[int, float]] = {}
        self.last_token: dict[int, float] = {}
        for _ in range(min(concurrency, requests)):
            self._submit()

    def _submit(self) -> None:
        number = self.pending.popleft()
        # Each pass over the prompts of each run is its own prefix scope: a prompt is never served from its own rows
        # of an earlier pass, another mode's or an earlier run's (a benchmark's repetition of its prompt set is not a
        # workload's), while the heads its prompts share are reused within the pass.
        scope, prompt = (self.run, number // len(self.prompts)), number % len(self.prompts)
        sequence = Sequence(self.prompts[prompt], self.lengths[prompt], prefix_scope=scope)
        self.scheduler.submit(sequence)
        self.started[id(sequence)] = (number, self.result.seconds)

    @property
    def finished_share(self) -> float:
        """The share of its requests finished."""
        return 1.0 - (len(self.pending) + len(self.started)) / self.result.requests

    def step(self) -> None:
        """One scheduler step; its seconds advance this mode's clock."""
        began = time.perf_counter()
        emitted = self.scheduler.step()
        elapsed = time.perf_counter() - began
        now = self.result.seconds = self.result.seconds + elapsed
        result, scheduler = self.result, self.scheduler
        if scheduler.last_batch:
            result.step_seconds.append(elapsed - scheduler.last_prefill_seconds)
            result.graph_seconds.append(scheduler.last_graph_seconds)
            result.widths.append(scheduler.last_width)
        for sequence, tokens in emitted:
            key = id(sequence)
            if tokens:
                if key not in self.last_token:
                    result.ttfts.append(now - self.started[key][1])
                else:
                    result.inter_token.extend([(now - self.last_token[key]) / len(tokens)] * len(tokens))
                self.last_token[key] = now
                result.tokens += len(tokens)
            if sequence.finished:
                number, _ = self.started.pop(key)
                self.last_token.pop(key, None)
                result.record(number % len(self.prompts), sequence.tokens)
                result.prompt_tokens += len(sequence.prompt)
                result.reused_prompt_tokens += sequence.stats.reused_prompt_tokens
                if self.pending:
                    self._submit()


def run_load(
    engine: GraphEngine,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    requests: int,
    modes: tuple[str, ...],
    alone_requests: int = 0,
    alone_first: bool = True,
    settings: LoadSettings = LoadSettings(),
) -> dict[str, LoadResult]:
    """For each mode, `requests` greedy requests over `concurrency` closed-loop clients (prompts taken in turn), the
    modes' schedulers on their own slots of one engine, stepping in turn, each timed on its own clock: a machine
    whose speed drifts weighs on every mode alike (this 2-core CPU's speed moves by up to 18% between back-to-back
    one-minute runs, more than the differences measured). With `alone_requests`, one at a time over that many
    requests too, taking turns with them in slices (`take_turns`; `alone_first`: it has the first slice). Every
    scheduler serves and every request asks as `settings` says."""
    needed = concurrency * len(modes) + (1 if alone_requests else 0)
    if needed > engine.pool.slots:
        raise ValueError(
            f"{len(modes)} modes x {concurrency} clients{' and one at a time' if alone_requests else ''} need {needed} "
            f"slots; the engine has {engine.pool.slots}: load it with more"
        )
    loops = [_ClosedLoop(engine, prompts, max_tokens, concurrency, requests, mode, settings) for mode in modes]
    groups = [loops]
    if alone_requests:
        alone = [_ClosedLoop(engine, prompts, max_tokens, 1, alone_requests, "one-at-a-time", settings)]
        groups = [alone, loops] if alone_first else [loops, alone]
    take_turns(groups, SLICE_SECONDS if alone_requests else float("inf"))
    return {loop.result.mode: loop.result for group in groups for loop in group}


def take_turns(groups: list[list[_ClosedLoop]], slice_seconds: float) -> None:
    """Run every group's loops to the end: a group's loops step in turn (lock step), and groups take turns in slices
    of about `slice_seconds` of wall time (at least one step each), the next slice going to the group furthest behind
    in its share of requests finished (the first listed on a tie)."""

    def busy(group: list[_ClosedLoop]) -> bool:
        return any(loop.scheduler.busy for loop in group)

    while any(busy(group) for group in groups):
        group = min((g for g in groups if busy(g)), key=lambda g: min(loop.finished_share for loop in g))
        began = time.perf_counter()
        while True:
            for loop in group:
                if loop.scheduler.busy:
                    loop.step()
            if not busy(group) or time.perf_counter() - began >= slice_seconds:
                break


def round_order(number: int) -> tuple[str, ...]:
    """The batched modes of round `number` at each level, stepping in turn (`run_load`): DFlash and plain decoding,
    which steps first alternating by round (as does whether one at a time or they have the first slice)."""
    return ("dflash", "plain") if number % 2 == 0 else ("plain", "dflash")


def slots_for(levels: list[int]) -> int:
    """Slots an engine needs for `load_table` at these levels: the largest level's clients for every mode that runs
    side by side (`round_order`), and one at a time's one."""
    return max(levels) * len(round_order(0)) + 1


def requests_at(concurrency: int, prompt_count: int, per_client: int = REQUESTS_PER_CLIENT) -> int:
    """Requests of a run at `concurrency`: the fewest whole passes over the prompts that give each client
    `per_client` requests (so every prompt is served equally often and the batch stays full for most of the run)."""
    return max(1, -(-per_client * concurrency // prompt_count)) * prompt_count


def load_table(
    engine: GraphEngine,
    prompts: list[list[int]],
    max_tokens: int,
    levels: list[int],
    rounds: int = 2,
    per_client: int = REQUESTS_PER_CLIENT,
    settings: LoadSettings = LoadSettings(),
) -> list[dict[str, Any]]:
    """Every mode at every concurrency level, in one process, in `rounds` rounds (at each level `round_order` in
    lock step, one at a time over as many requests taking turns with them); each row also says whether its outputs
    equal plain decoding's at that level (for every request of every prompt, in every round) and its tok/s over the
    other two modes' at that level."""
    if slots_for(levels) > engine.pool.slots:
        raise ValueError(
            f"concurrency {max(levels)} needs {slots_for(levels)} of the engine's {engine.pool.slots} slots (DFlash and "
            "plain decoding side by side, and one at a time): load it with more"
        )
    requests = {concurrency: requests_at(concurrency, len(prompts), per_client) for concurrency in levels}
    pooled: dict[tuple[int, str], LoadResult] = {}
    for number in range(rounds):
        for concurrency in levels:
            results = _run_with_progress(engine, prompts, max_tokens, concurrency, requests[concurrency], number, settings)
            for mode, result in results.items():
                pooled[concurrency, mode] = _pooled(pooled.get((concurrency, mode)), result)
    rows = []
    for concurrency in levels:
        plain, alone = pooled[concurrency, "plain"], pooled[concurrency, "one-at-a-time"]
        for result in (pooled[concurrency, "dflash"], alone, plain):
            row = {**result.summary(), "concurrency": concurrency, "requests_per_round": result.requests // rounds}
            row["identical_to_plain"] = result.outputs == plain.outputs and result.consistent and plain.consistent
            row["over_plain"] = row["tok_s"] / plain.summary()["tok_s"]
            row["over_one_at_a_time"] = row["tok_s"] / alone.summary()["tok_s"]
            rows.append(row)
            print(
                f"[dflash-bench] concurrency {concurrency:>3} {result.mode:<13} {row['tok_s']:8.1f} tok/s "
                f"TTFT p50/p99 {row['ttft_ms_p50']:.0f}/{row['ttft_ms_p99']:.0f} ms "
                f"ITL p50/p99 {row['itl_ms_p50']:.1f}/{row['itl_ms_p99']:.1f} ms "
                f"width {row['mean_verify_width']:.1f} host {row['host_share_of_step']:.1%} "
                f"reused prompt {row['reused_prompt_share']:.0%} "
                f"({row['requests_per_round']} requests from {result.concurrency} client(s) per round)",
                flush=True,
            )
    return rows


def _run_with_progress(
    engine: GraphEngine,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    requests: int,
    number: int,
    settings: LoadSettings,
) -> dict[str, LoadResult]:
    """Round `number` at one level (`run_load`: `round_order`, and one at a time beside them), with a progress line
    per mode: a table's runs take minutes each."""
    modes, first = round_order(number), number % 2 == 0
    results = run_load(
        engine,
        prompts,
        max_tokens,
        concurrency,
        requests,
        modes,
        alone_requests=requests,
        alone_first=first,
        settings=settings,
    )
    for mode, result in results.items():
        print(
            f"[dflash-bench] round {number + 1}: {mode} with {result.concurrency} client(s), {result.requests} requests: "
            f"{result.tokens / result.seconds:.1f} tok/s over {result.seconds:.0f} s of its own steps",
            flush=True,
        )
    return results


def _pooled(pooled: LoadResult | None, result: LoadResult) -> LoadResult:
    return result if pooled is None else pooled.merged(result)
