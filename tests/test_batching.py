"""In-flight batching: sequences in pool slots, joining and leaving a running batch, each exactly as if served alone."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.networks import load_pair
from dflash_trt.runtime.engine import GraphEngine, StepBatch, StepResult
from dflash_trt.runtime.loop import GenerationStats, Sequence, generate, generate_plain
from dflash_trt.runtime.sampling import RequestError, SamplingParams
from dflash_trt.runtime.scheduler import (
    CALIBRATED_DRAFTS,
    AdaptiveVerify,
    FixedVerify,
    PlainDecoding,
    Scheduler,
    StepCosts,
    calibration_batches,
)
from dflash_trt.runtime.states import StatePool, StateSpec

SLOTS = 4


@pytest.fixture(scope="module")
def engine(tiny_targets: dict[str, Path], trained_drafter: Path) -> GraphEngine:
    return torch_engine(*load_pair(tiny_targets["qwen3"], trained_drafter), max_seq_len=256, max_batch=SLOTS)


def _requests(count: int, seed: int) -> list[Sequence]:
    """Mixed prompt lengths and max_tokens; every third request sampled with its own seed."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for index in range(count):
        length = int(torch.randint(2, 30, (1,), generator=generator))
        prompt = torch.randint(1, 90, (length,), generator=generator).tolist()
        sampling = SamplingParams(0.9, top_k=20, seed=100 + index) if index % 3 == 2 else SamplingParams()
        requests.append(Sequence(prompt, int(torch.randint(5, 48, (1,), generator=generator)), sampling))
    return requests


def _run_all(scheduler: Scheduler, sequences: list[Sequence]) -> tuple[dict[int, list[int]], list[int]]:
    """Serve the sequences to the end: (tokens streamed to each, by id; rows of every batched step)."""
    streamed: dict[int, list[int]] = {id(s): [] for s in sequences}
    batch_sizes = []
    for sequence in sequences:
        scheduler.submit(sequence)
    while scheduler.busy:
        for sequence, tokens in scheduler.step():
            streamed[id(sequence)].extend(tokens)
        batch_sizes.append(scheduler.last_batch)
    return streamed, batch_sizes


def test_batched_outputs_equal_each_request_served_alone(engine: GraphEngine) -> None:
    requests = _requests(10, seed=0)  # 10 requests, 4 slots: six join a running batch as others leave
    alone = [generate(engine, r.prompt, r.max_new_tokens, r.sampling).tokens for r in requests]
    streamed, batch_sizes = _run_all(Scheduler(engine), requests)
    for request, expected in zip(requests, alone, strict=True):
        assert request.tokens == expected, f"prompt {request.prompt}: batched output differs from the same request alone"
        assert streamed[id(request)] == expected, "what was streamed is what was generated"
    assert max(batch_sizes) == SLOTS and engine.pool.free_slots == SLOTS
    assert any(r.stats.accepted_draft_tokens > 0 for r in requests), "drafts were accepted in the batch"


def test_a_request_that_ends_in_its_first_step_is_reported_once_with_every_token(engine: GraphEngine) -> None:
    """Admitted and finished in one step(): one entry carrying the prefill's token and the step's. (Reported twice,
    the server ended the request at the first entry, whose sequence was already finished, and dropped the rest:
    max_tokens=2 streamed one token.)"""
    prompt = [3, 14, 15, 9, 26]
    for max_tokens in (1, 2):  # the prefill gives one token, any step at least one more
        sequence = Sequence(prompt, max_tokens)
        scheduler = Scheduler(engine)
        scheduler.submit(sequence)
        reports = scheduler.step()
        assert sequence.finished
        assert [s for s, _ in reports] == [sequence]
        assert reports[0][1] == sequence.tokens == generate_plain(engine, prompt, max_tokens).tokens


@pytest.mark.parametrize("drafts", [0, 1, 3, 7, 15])
def test_any_verify_length_keeps_outputs_exact(engine: GraphEngine, drafts: int) -> None:
    requests = _requests(6, seed=1)
    alone = [generate_plain(engine, r.prompt, r.max_new_tokens, r.sampling).tokens for r in requests]
    _run_all(Scheduler(engine, FixedVerify(drafts)), requests)
    assert [r.tokens for r in requests] == alone
    assert all(r.stats.draft_tokens == drafts * r.stats.steps for r in requests), "each step verified `drafts` drafts"


def test_adaptive_verify_chooses_plain_decoding_when_drafts_do_not_pay(engine: GraphEngine) -> None:
    """With drafting made costly and acceptance poor, the policy picks k = 0 (verify graph, no drafting); outputs stay
    exact. (The costs and counts are set by hand between choices: every step decides anew, `hold_steps=0`.)"""
    policy = AdaptiveVerify(engine.block_size, StepCosts(), explore_budget=1e9, hold_steps=0)
    for tokens in (1, 2, 4, 8, 16, 64):
        policy.costs.record("verify", tokens, 0.01 + 0.0005 * tokens)  # a verify of 16 costs under twice one of 1
    policy.costs.record("draft", 16, 0.001)  # drafting 15 at one row: 16 block slots
    for step in range(policy.warmup_rows):  # acceptance is measured before it is weighed
        assert policy.choose(1) == engine.block_size - 1, f"warm-up step {step}"
        policy.observe("step", 1, engine.block_size, 0.019, [0], drafted=engine.block_size - 1)
    policy.costs.seconds["draft"], policy.costs.seconds["run15"] = {16: 1.0}, {1: 1.018}  # drafting made costly
    assert policy.choose(1) == 0
    policy.costs.seconds["draft"], policy.costs.seconds["run15"] = {16: 0.001}, {1: 0.019}  # drafting made cheap
    policy.accepted[1:] = policy.reached[1:]  # every draft accepted so far: verifying all pays
    assert policy.choose(1) == engine.block_size - 1
    policy.accepted[3:] = 0.0  # nothing past the second draft is ever accepted: verify two
    assert policy.choose(1) == 2
    requests = _requests(4, seed=2)
    alone = [generate_plain(engine, r.prompt, r.max_new_tokens, r.sampling).tokens for r in requests]
    live = AdaptiveVerify(engine.block_size)
    live.calibrate(engine)
    _run_all(Scheduler(engine, live), requests)
    assert [r.tokens for r in requests] == alone


@dataclass
class ScriptedVerify:
    """Verifies the k of a fixed script, one per step (then 0), running `graph_when_idle` where k = 0 (or, with
    `idle_script`, the graph it lists for that step)."""

    script: list[int]
    graph_when_idle: str
    calls: list[str] = field(default_factory=list)  # the graphs run, catch-ups included
    idle_script: list[str] = field(default_factory=list)
    lookup_limit: int = 0
    lookup_script: list[int] = field(default_factory=list)  # lookup drafts asked on each step that drafts nothing
    widths: list[int] = field(default_factory=list)  # each graph call's verify width

    def choose(self, batch: int, behind: int = 0, rows: tuple[GenerationStats, ...] = (), left: float = np.inf) -> int:
        if self.idle_script:
            self.graph_when_idle = self.idle_script.pop(0)
        return self.script.pop(0) if self.script else 0

    def lookup_drafts(self, graph: str, batch: int, available: list[int]) -> int:
        return self.lookup_script.pop(0) if self.lookup_script else 0

    def observe(
        self,
        graph: str,
        batch: int,
        width: int,
        seconds: float,
        accept_lens: list[int],
        drafted: int = 0,
        looked_up: list[int] | None = None,
    ) -> None:
        self.calls.append(graph)
        self.widths.append(width)


SWITCHING = [0, 0, 0, 0, 0, 15, 15, 15, 0, 0, 0, 15, 15, 0, 0, 15]  # plain stretches, then the whole block


def test_plain_stretches_on_decode_catch_the_drafter_up_before_it_drafts(engine: GraphEngine) -> None:
    """Plain steps on `decode` (no drafter context) and on `verify` (which keeps it) over one script: the step that
    switches drafting on catches the drafter's context up instead, and every later step accepts exactly what it
    accepts after `verify` steps (the same drafts: the recomputed context rows are those `verify` wrote); outputs
    equal plain decoding, sampled ones too."""
    for sampling in (SamplingParams(), SamplingParams(0.9, top_k=20, seed=7)):
        prompt = [5, 17, 33, 2, 71, 8, 40, 12]
        plain = generate_plain(engine, prompt, 40, sampling).tokens
        runs = {}
        for idle in ("verify", "decode"):
            policy = ScriptedVerify(list(SWITCHING), idle)
            runs[idle] = generate(engine, prompt, 40, sampling, policy=policy)
            assert runs[idle].tokens == plain, f"{idle}: outputs differ from plain decoding ({sampling})"
            switch_ons = policy.calls.count("catch_up")
            assert switch_ons == (3 if idle == "decode" else 0), policy.calls
        assert runs["decode"].stats.acceptance_lengths == runs["verify"].stats.acceptance_lengths
        assert runs["decode"].stats.accepted_draft_tokens > 0


def test_lookup_drafts_keep_outputs_exact_on_both_plain_graphs(engine: GraphEngine) -> None:
    """Plain steps that verify lookup drafts (`runtime.lookup`) instead, on `verify` and on `decode`, beside steps
    that draft, in a batch with sampled rows and rows that have fewer lookup drafts than asked (padded): every output
    equals plain decoding, lookup drafts were verified and accepted, and they are not counted as the drafter's."""
    requests = _requests(6, seed=3)
    alone = [generate_plain(engine, r.prompt, r.max_new_tokens, r.sampling).tokens for r in requests]
    for idle in ("verify", "decode"):
        served = [Sequence(list(r.prompt), r.max_new_tokens, r.sampling) for r in requests]
        policy = ScriptedVerify(list(SWITCHING) * 3, idle, lookup_limit=4, lookup_script=[4, 2, 1, 3] * 40)
        _run_all(Scheduler(engine, policy), served)
        assert [r.tokens for r in served] == alone, f"{idle}: outputs differ from plain decoding"
        assert max(policy.widths) == 1 + engine.block_size - 1 and 5 in policy.widths  # steps that draft, and lookups
        assert sum(r.stats.lookup_tokens for r in served) > 0 and sum(r.stats.lookup_accepted for r in served) > 0
        for r in served:  # the drafter's steps verify whole blocks; lookup steps 1-4 tokens, counted apart
            assert r.stats.draft_tokens % (engine.block_size - 1) == 0 and r.stats.lookup_accepted <= r.stats.lookup_tokens


def _recording_step_blocks(
    engine: GraphEngine, rows: list[Sequence], seen: list[tuple[list[int], list[int]]]
) -> Callable[[str, StepBatch], StepResult]:
    """`engine.run` that first appends, for each row of a `step` call, (the row's lookup proposal then, its block)."""
    run = engine.run

    def recording(graph: str, batch: StepBatch) -> StepResult:
        if graph == "step":
            for slot, block in zip(batch.slots.tolist(), batch.block.tolist(), strict=True):
                row = next(s for s in rows if s.slot == slot)
                seen.append((row.lookup.propose(len(block) - 1), block))
        return run(graph, batch)

    return recording


def test_lookup_drafts_take_the_first_slots_of_a_drafting_step(engine: GraphEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With lookup drafts on, a step that drafts verifies each row's lookup drafts (`runtime.lookup`) in its first
    block slots and the drafter's after them: every `step` call's block holds what the row's text proposed; outputs
    equal plain decoding, greedy and sampled rows in one batch. With lookup drafts off the blocks are the drafter's."""
    requests = _requests(6, seed=5)
    alone = [generate_plain(engine, r.prompt, r.max_new_tokens, r.sampling).tokens for r in requests]
    for lookup_limit in (4, 0):
        served = [Sequence(list(r.prompt), r.max_new_tokens, r.sampling) for r in requests]
        seen: list[tuple[list[int], list[int]]] = []  # (a row's proposal when its `step` call ran, the block it got)
        monkeypatch.setattr(engine, "run", _recording_step_blocks(engine, served, seen))
        _run_all(Scheduler(engine, ScriptedVerify([4] * 400, "verify", lookup_limit=lookup_limit)), served)
        monkeypatch.undo()
        assert [r.tokens for r in served] == alone, f"lookup_limit {lookup_limit}: outputs differ from plain decoding"
        proposed = [(p, block) for p, block in seen if p]
        assert len(proposed) > 10, "the requests' texts proposed too few lookup drafts to test with"
        from_lookup = [block[1 : 1 + len(p)] == p for p, block in proposed]
        assert all(from_lookup) if lookup_limit else not all(from_lookup)
        in_blocks = sum(r.stats.lookup_in_blocks for r in served)
        assert in_blocks == (sum(len(p) for p, _ in proposed) if lookup_limit else 0)


def test_adaptive_verify_weighs_lookup_drafts_by_their_cost_and_acceptance() -> None:
    """`AdaptiveVerify.lookup_drafts`: the width that maximises expected tokens per second from the measured cost of
    each width and the lookup drafts' measured acceptance; none where wider steps cost more than they bring, where a
    width's cost is unknown, or where no row has a lookup draft. Lookup steps teach lookup acceptance only."""
    policy = AdaptiveVerify(16)
    for width, seconds in ((1, 0.030), (2, 0.031), (3, 0.032), (4, 0.033), (5, 0.034)):
        policy.costs.record(f"decode@{width}", 1, seconds)
    assert policy.lookup_drafts("decode", 1, [0]) == 0  # nothing to verify
    assert policy.lookup_drafts("verify", 1, [4]) == 0  # no cost measured for that graph
    assert policy.lookup_drafts("decode", 1, [4]) == 4  # the prior: each draft accepted half the times it is reached
    assert policy.lookup_drafts("decode", 1, [2]) == 2  # a row with two drafts gains nothing from a wider step
    first_reached = policy.reached.copy()
    for _ in range(200):  # lookup drafts that are never accepted
        policy.observe("decode", 1, 5, 0.034, [0], looked_up=[4])
    assert policy.lookup_drafts("decode", 1, [4]) == 0
    assert (policy.reached == first_reached).all(), "lookup steps teach nothing about the drafter's drafts"
    for _ in range(200):  # the first lookup draft always accepted, the second never
        policy.observe("decode", 1, 5, 0.034, [1], looked_up=[4])
    assert policy.lookup_drafts("decode", 1, [4]) == 1
    for width in range(2, 6):  # any lookup draft made as costly as a second step
        policy.costs.seconds[f"decode@{width}"] = {1: 0.060}
    assert policy.lookup_drafts("decode", 1, [4]) == 0


def test_lookup_drafts_weigh_a_wide_steps_cost_as_moved_with_the_plain_steps_since_it_was_timed() -> None:
    """A `decode` of 1 + 1 lookup draft timed at 1.5 plain steps (calibration) does not pay for a draft accepted 40% of
    the time; live plain steps then cost twice as much (a batch's rows read the past of its longest): the wide step,
    not run since, still weighs 1.5 of them, not 0.75, so lookup drafts stay off; timed again at 1.3, they pay."""
    policy = AdaptiveVerify(16, lookup_limit=1)
    policy._calibrated("decode", 16, 1, 0, 0.100)
    policy._calibrated("decode", 16, 2, 0, 0.150)
    for _ in range(400):  # 16 rows with one lookup draft each, accepted in 40% of rows
        policy._learn_lookup([1] * 6 + [0] * 10, [1] * 16)
    assert policy.lookup_drafts("decode", 16, [1] * 16) == 0
    for _ in range(40):  # the plain step now costs twice what it did
        policy.observe("decode", 16, 1, 0.200, [0] * 16)
    assert policy.costs.estimate("decode@2", 16) == pytest.approx(0.150)  # as timed, below today's plain step
    assert policy.lookup_drafts("decode", 16, [1] * 16) == 0
    for _ in range(40):  # the wide step timed again at 1.3 plain steps
        policy.observe("decode", 16, 2, 0.260, [1] * 6 + [0] * 10, looked_up=[1] * 16)
    assert policy.lookup_drafts("decode", 16, [1] * 16) == 1


def test_verify_steps_after_decode_steps_leave_the_gap_to_the_catch_up(engine: GraphEngine) -> None:
    """Plain steps that turn from `decode` to `verify` (the policy no longer rules drafting out) while the row's
    drafter context lags: those steps run `decode` (what `verify` would write there, the catch-up recomputes) and the
    context still ends where `decode` left it, so the step that drafts catches up first and then accepts exactly
    what it accepts after `verify` steps throughout. (Before, such a `verify` step marked the context current over the
    gap, and the drafter read stale rows there.)"""
    prompt = [5, 17, 33, 2, 71, 8, 40, 12]
    script = [3, 0, 0, 0, 0, 0, 15, 15, 15]
    reference = generate(engine, prompt, 40, policy=ScriptedVerify(list(script), "verify"))
    policy = ScriptedVerify(list(script), "decode", idle_script=["decode"] * 4 + ["verify"] * 2 + ["decode"] * 40)
    switched = generate(engine, prompt, 40, policy=policy)
    assert switched.tokens == reference.tokens
    assert policy.calls[:8] == ["step"] + ["decode"] * 5 + ["catch_up", "step"], policy.calls
    assert switched.stats.acceptance_lengths == reference.stats.acceptance_lengths


def test_a_next_turn_reuses_the_answer_only_as_far_as_the_drafter_context_reaches(engine: GraphEngine) -> None:
    """After `decode` steps the slot lacks the drafter's rows of their tokens: a next turn reuses the conversation up
    to where the drafter's context ends, and its output equals prefilling it whole."""
    prompt = [9, 18, 27, 36, 45, 54, 63, 72]
    sequence = Sequence(prompt, 30)
    _run_all(Scheduler(engine, ScriptedVerify([3, 3], "decode")), [sequence])  # <= 9 tokens, then `decode` steps
    follow_up = prompt + sequence.tokens + [5, 6]
    assert len(prompt) < sequence.context_end < len(prompt) + len(sequence.tokens) - 1
    assert engine.prefixes.longest(follow_up)[1] == sequence.context_end
    reused = generate(engine, follow_up, 12)
    assert reused.stats.reused_prompt_tokens == sequence.context_end
    engine.reuse_prefixes = False
    try:
        assert generate(engine, follow_up, 12).tokens == reused.tokens
    finally:
        engine.reuse_prefixes = True


def test_rows_behind_catch_up_in_one_call_and_the_rest_step(engine: GraphEngine) -> None:
    """A batch where some rows ran `decode` steps since they drafted and others joined since: those behind catch up
    together (a longer catch-up recomputes more of a shorter one's generated rows), the others verify; every output
    equals plain decoding."""
    requests = _requests(6, seed=4)
    alone = [generate_plain(engine, r.prompt, r.max_new_tokens, r.sampling).tokens for r in requests]
    policy = ScriptedVerify([3, 0, 0, 0, 5, 0, 0, 7, 7, 0, 15, 0, 0, 0, 2] * 8, "decode")
    _run_all(Scheduler(engine, policy), requests)
    assert [r.tokens for r in requests] == alone
    assert "catch_up" in policy.calls and "decode" in policy.calls


def test_plain_steps_run_decode_only_where_drafting_is_ruled_out() -> None:
    """`verify` keeps the drafter's context for a look that may switch drafting on; `decode` is cheaper where drafting
    would not pay even with the first draft's acceptance read one standard error higher. Engines that cannot catch
    the context up (recurrent states) always run `verify`."""

    def policy_with(reached: float, accepted: float, can_catch_up: bool) -> AdaptiveVerify:
        policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9, warmup_rows=0, can_catch_up=can_catch_up)
        for k in range(16):
            policy.costs.record(f"run{k}", 1, 0.020 if k == 0 else 0.024 + 0.001 * k)  # break-even: first draft at 0.25
        policy.reached[1], policy.accepted[1] = reached, accepted
        return policy

    for can_catch_up in (True, False):
        policy = policy_with(100.0, 5.0, can_catch_up)  # 0.05 on ample evidence: ruled out
        assert policy.choose(1) == 0 and policy.graph_when_idle == ("decode" if can_catch_up else "verify")
        policy = policy_with(8.0, 1.6, can_catch_up)  # 0.2 on thin evidence: plain for now, drafting may pay soon
        assert policy.choose(1) == 0 and policy.graph_when_idle == "verify"


def test_drafting_resumes_over_a_catch_up_only_where_the_tokens_left_repay_it() -> None:
    """Rows 100 tokens behind (after `decode` steps) with drafting now paying 1.65x: switching it on first recomputes
    those rows (0.3 s here, 14 plain steps beyond the plain step it replaces). With 20 tokens left per row drafting
    would save ~8 plain steps, less than the catch-up costs: plain decoding goes on; with 500 left it drafts; with no
    rows behind it drafts whatever is left."""
    policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9, warmup_rows=0, hold_steps=0)  # three cases, one policy
    for k in range(16):
        policy.costs.record(f"run{k}", 1, 0.020 if k == 0 else 0.024 + 0.001 * k)
    policy.costs.record("catch_up", 100, 0.300)
    policy.reached[1:], policy.accepted[1:] = 100.0, 60.0  # 1 + 0.6 + 0.36 ... tokens per step
    assert policy.choose(1, behind=100, left=20) == 0
    best = policy.choose(1, behind=100, left=500)
    assert best > 0
    assert policy.choose(1, behind=0, left=20) == best


def test_adaptive_verify_warms_up_only_where_drafting_could_pay() -> None:
    """Before acceptance is measured, a batch where drafting steps cost many plain ones (compute-bound: 16 rows
    verifying whole blocks, ~29 plain steps) decodes plainly instead of verifying whole blocks to measure; batch 1,
    where the whole block costs under twice a 1-token verify, verifies it. Warm-up counts the rows of drafting
    steps: one step of 16 rows measures what 16 steps of one row do."""
    policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9)
    for tokens, seconds in ((1, 0.030), (16, 0.045), (64, 0.300), (256, 1.200)):
        policy.costs.record("verify", tokens, seconds)
    policy.costs.record("draft", 16, 0.010)  # 1 row x 16 block slots
    policy.costs.record("draft", 256, 0.100)  # 16 rows
    for _ in range(3):
        assert policy.choose(16) == 0
        policy.observe("verify", 16, 1, 0.045, [0] * 16)
    assert policy.drafted_rows == 0
    assert policy.choose(1) == 15
    policy.observe("step", 1, 16, 0.055, [3], drafted=15)
    assert policy.drafted_rows == 1
    policy.observe("step", 16, 2, 0.200, [0] * 16, drafted=1)  # one step of 16 rows ends the warm-up
    assert policy.drafted_rows == 17


def test_adaptive_verify_learns_costs_from_warm_shapes_only() -> None:
    """A shape's first call (which also plans its memory) is not taken for its cost; later ones are; a batch-1
    step cost is not stretched to a larger batch (per-row costs fall with the batch): that comes from its parts."""
    policy = AdaptiveVerify(16, StepCosts())
    policy.observe("step", 1, 3, 0.500, [1], drafted=2)  # first call of this shape: slow
    assert "run2" not in policy.costs.seconds
    policy.observe("step", 1, 3, 0.030, [1], drafted=2)
    assert policy.costs.seconds["run2"] == {1: 0.030}
    assert policy.step_cost(1, 2) == 0.030
    assert policy.step_cost(4, 2) is None, "no verify or drafting cost known at batch 4"
    policy.costs.record("verify", 12, 0.040)
    policy.costs.record("draft", 12, 0.010)  # 4 rows x 3 block slots
    assert policy.step_cost(4, 2) == pytest.approx(0.050)


def test_drafting_cost_at_a_new_batch_size_comes_from_the_block_slots_denoised() -> None:
    """Before a step of k drafts has run at a batch size, its drafting is estimated from drafting the same number of
    block slots (batch x (1 + k)) elsewhere: 4 rows drafting 2 from 1 row drafting 11, not from 4 rows drafting 15."""
    policy = AdaptiveVerify(16, StepCosts())
    for tokens, seconds in ((1, 0.030), (12, 0.040), (16, 0.045), (64, 0.090)):
        policy.costs.record("verify", tokens, seconds)
    policy.observe("step", 1, 12, 0.048, [0], drafted=11)
    policy.observe("step", 1, 12, 0.048, [0], drafted=11)  # 12 block slots drafted: 8 ms beyond the verify
    policy.observe("step", 4, 1, 0.120, [0] * 4, drafted=15)
    policy.observe("step", 4, 1, 0.120, [0] * 4, drafted=15)  # 64 block slots: 87 ms beyond verifying 4 tokens
    assert policy.step_cost(4, 2) == pytest.approx(0.040 + 0.008)


def test_rarely_run_step_costs_follow_the_plain_steps_cost() -> None:
    """At 16 rows a 1-draft step costs 1.5 plain steps when both are timed together (calibration). When live plain
    steps later read 25% slower (longer contexts, a slow minute), the 1-draft step is costed 25% slower too, not at
    its old time against the new plain one: with first drafts accepted 45% of the time drafting stays off (1.45
    tokens for 1.5 plain steps), where the unscaled costs (1.2 plain steps) would switch it on."""
    policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9, warmup_rows=0)
    policy._calibrated("verify", 16, 1, 0, 0.080)
    policy._calibrated("step", 16, 2, 1, 0.120)
    policy.reached[1], policy.accepted[1] = 100.0, 45.0
    policy.accepted[2:] = 0.0
    assert policy.choose(16) == 0
    for _ in range(20):
        policy.observe("verify", 16, 1, 0.100, [0] * 16)
    plain = policy.step_cost(16, 0)
    assert plain == pytest.approx(0.100, rel=0.01)
    assert policy.step_cost(16, 1) == pytest.approx(1.5 * plain)
    assert policy.choose(16) == 0
    policy.observe("step", 16, 2, 0.140, [0] * 16, drafted=1)  # a look at k = 1: its cost now, next to today's plain step
    assert 0.140 < policy.step_cost(16, 1) < 0.150, "between the look's time and the scaled calibration"


def test_adaptive_verify_calibrates_few_draft_steps_at_every_batch_size(engine: GraphEngine) -> None:
    """Calibration times steps of 1 .. CALIBRATED_DRAFTS drafts at every batch size it calibrates (costed from parts
    they mislead at larger batches), every k at batch 1, and hands every slot back."""
    free = engine.pool.free_slots
    batches = calibration_batches(engine, 256)
    policy = AdaptiveVerify(engine.block_size)
    policy.calibrate(engine, max_tokens=256)
    assert len(batches) > 2
    for k in range(1, CALIBRATED_DRAFTS + 1):
        assert sorted(policy.costs.seconds[f"run{k}"]) == [b for b in batches if b * (k + 1) <= 256], f"k = {k}"
    assert sorted(policy.costs.seconds[f"run{CALIBRATED_DRAFTS + 1}"]) == [1]
    assert engine.pool.free_slots == free


def test_adaptive_verify_is_not_switched_on_by_one_lucky_draft() -> None:
    """After a long run of plain steps the decayed evidence is thin; one accepted look must not turn drafting back
    on when drafting costs 30% more, while steady acceptance does."""
    policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9)
    for k in range(16):
        policy.costs.record(f"run{k}", 1, 0.024 if k == 0 else 0.031 + 0.001 * k)
    for _ in range(50):
        policy.observe("step", 1, 3, 0.033, [0], drafted=2)  # drafts never accepted
    assert policy.choose(1) == 0
    for _ in range(2000):
        policy.observe("verify", 1, 1, 0.024, [0])  # a long run of plain steps: evidence decays
    policy.observe("step", 1, 3, 0.033, [2], drafted=2)  # one look, both drafts accepted
    assert policy.choose(1) == 0
    for _ in range(30):
        policy.observe("step", 1, 3, 0.033, [2], drafted=2)
    assert policy.choose(1) > 0


def test_adaptive_verify_switches_drafting_on_only_for_a_clear_gain() -> None:
    """At 4 rows, where a step with one draft costs 1.49 plain steps (the demo engine: 57.7 vs 38.8 ms), drafting
    pays above 0.49 acceptance. Thin evidence at 0.4 plus one lucky look (3 of 4 rows accepted) reads 0.52: 2% more
    tokens per second than plain decoding, which does not switch drafting on (without the margin it would); steady
    acceptance of 0.625 (9% more) does, and 0.4 over many rows switches it off again."""

    def policy_after_a_lucky_look(margin: float) -> AdaptiveVerify:
        policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9, warmup_rows=0, switch_on_margin=margin)
        for k in range(16):
            policy.costs.record(f"run{k}", 4, 0.0388 if k == 0 else 0.0577 + 0.004 * (k - 1))
        policy.reached[1], policy.accepted[1] = policy.evidence_floor, 0.4 * policy.evidence_floor  # decayed
        policy.accepted[2:] = 0.0
        assert policy.choose(4) == 0
        policy.observe("step", 4, 2, 0.0577, [1, 1, 1, 0], drafted=1)
        assert policy.accepted[1] / policy.reached[1] > 0.49, "the mean says drafting pays"
        return policy

    assert policy_after_a_lucky_look(0.0).choose(4) == 1
    policy = policy_after_a_lucky_look(0.05)
    assert policy.choose(4) == 0
    for _ in range(100):
        policy.observe("step", 4, 2, 0.0577, [1, 1, 0, 0], drafted=1)  # steady: half accepted ...
        policy.observe("step", 4, 2, 0.0577, [1, 1, 1, 0], drafted=1)  # ... and three quarters: 0.625
    assert policy.choose(4) == 1
    for _ in range(200):
        policy.observe("step", 4, 2, 0.0577, [1, 0, 0, 0], drafted=1)  # then 0.4 over 800 rows
        policy.observe("step", 4, 2, 0.0577, [1, 1, 0, 0], drafted=1)
    assert policy.choose(4) == 0


def test_adaptive_verify_looks_less_often_while_looks_change_nothing() -> None:
    """Drafts never accepted: each look that leaves the choice at k = 0 doubles the time to the next one, up to
    2**quiet_looks_limit times, once the evidence rules drafting out (the first looks turn the prior's one half into
    a quarter or a sixth on two or three rows, where optimism could still draft: the next look comes as soon); once
    drafts are accepted and the choice changes, looks are as frequent as at first."""
    policy = AdaptiveVerify(16, StepCosts(), explore_budget=10.0, warmup_rows=0)
    costs = [0.024] + [0.031 + 0.001 * k for k in range(1, 16)]  # seconds of a step verifying k drafts
    for k, seconds in enumerate(costs):
        policy.costs.record(f"run{k}", 1, seconds)

    def look_times(steps: int, accepted: int) -> list[float]:
        """Seconds of steps run before each look began (drafts beyond the first `accepted` rejected)."""
        clock, began = 0.0, []
        for _ in range(steps):
            looks = policy.looks
            k = policy.choose(1)
            if policy.looks > looks:
                began.append(clock)
            policy.observe("step" if k else "verify", 1, 1 + k, costs[k], [min(accepted, k)], drafted=k)
            clock += costs[k]
        return began

    began = look_times(2000, accepted=0)
    base = policy.explore_budget * 2 * (costs[2] - costs[0])  # steps' seconds before a look, at first
    gaps = [b - a for a, b in pairwise([0.0, *began])]
    spacing = [round(g / base) for g in gaps]
    fading = spacing.index(2)  # looks made before the evidence ruled drafting out: at the first spacing
    assert 1 <= fading <= 3 and spacing[:fading] == [1] * fading
    assert spacing[fading:] == [2, 4, 8] + [16] * (len(gaps) - fading - 3), "doubling, at most 16x"
    assert len(gaps) > 6
    assert policy.choose(1) == 0
    policy.held = None  # the plain choice standing rests on counts the next line changes by hand
    policy.accepted[1:4] = policy.reached[1:4]  # drafts 1-3 now always accepted: drafting pays
    policy.accepted[4:] = 0.0
    best = int(np.argmax(policy.expected_rates(1)))
    assert best == 3
    began = look_times(200, accepted=3)
    assert began[0] == 0.0, "the steps since the last look already pay for a look at the new choice"
    gaps = [b - a for a, b in pairwise(began)]
    below, above = costs[best] - costs[best - 2], costs[best + 2] - costs[best]  # looks alternate around k = 3
    assert gaps[0] == pytest.approx(policy.explore_budget * 2 * above * 2, abs=0.05), "the second look: twice the budget"
    assert max(gaps) < 16 * policy.explore_budget * 2 * max(below, above) + 0.1


def test_plain_steps_decay_the_acceptance_counts_as_if_step_by_step() -> None:
    """Plain steps only count towards the decay, applied when the counts are next read: the same counts as decaying
    them by `decay` every step, never below `evidence_floor` (counts under it unchanged)."""
    policy = AdaptiveVerify(16, StepCosts())
    policy.observe("step", 4, 16, 0.1, [15, 7, 2, 0], drafted=15)
    policy.reached[1:4] += np.array([300.0, 40.0, 9.0])  # well above, near and just above the floor
    policy.accepted[1:4] += np.array([100.0, 20.0, 3.0])
    reached, accepted = policy.reached.copy(), policy.accepted.copy()
    for _ in range(250):
        policy.observe("decode", 4, 1, 0.05, [0] * 4)
        fading = np.maximum(policy.decay, np.minimum(policy.evidence_floor / reached, 1.0))
        reached, accepted = reached * fading, accepted * fading
    policy.acceptance()
    np.testing.assert_allclose(policy.reached, reached, rtol=1e-9)
    np.testing.assert_allclose(policy.accepted, accepted, rtol=1e-9)
    assert policy.reached[1] > policy.evidence_floor and policy.reached[3] == policy.evidence_floor


def test_a_plain_decoding_choice_stands_until_something_it_rests_on_changes() -> None:
    """Plain steps observe no draft, so a plain-decoding choice stands for `hold_steps` steps instead of being worked
    out anew every step (host time between graph calls): over 3,000 steps where drafts are never accepted, the
    choices, their idle graphs and the looks are those of a policy deciding every step, with a tenth of the
    decisions. A step that observes drafts, other rows or another batch size is decided anew at once."""
    costs = [0.024] + [0.031 + 0.001 * k for k in range(1, 16)]  # seconds of a step verifying k drafts

    def run(hold_steps: int) -> tuple[list[tuple[int, str]], int]:
        policy = AdaptiveVerify(16, StepCosts(), explore_budget=10.0, warmup_rows=0, hold_steps=hold_steps)
        for k, seconds in enumerate(costs):
            policy.costs.record(f"run{k}", 1, seconds)
        choices, decisions = [], 0
        for _ in range(3000):
            decisions += policy.held is None or policy.held.steps == 0
            k = policy.choose(1)
            choices.append((k, policy.graph_when_idle))
            policy.observe("step" if k else policy.graph_when_idle, 1, 1 + k, costs[k], [0], drafted=k)
        return choices, decisions

    (every_step, decided), (holding, held_decisions) = run(0), run(16)
    assert holding == every_step
    assert sum(k > 0 for k, _ in holding) >= 10, "looks came, at the same steps"
    assert held_decisions < decided / 10

    policy = AdaptiveVerify(16, StepCosts(), explore_budget=1e9, warmup_rows=0)
    for k, seconds in enumerate(costs):
        policy.costs.record(f"run{k}", 1, seconds)
        policy.costs.record(f"run{k}", 2, 1.5 * seconds)
    policy.reached[1:], policy.accepted[1:] = 100.0, 5.0  # drafts rarely accepted
    rows = (GenerationStats(16),)
    assert policy.choose(1, rows=rows) == 0 and policy.held is not None
    assert policy.choose(1, rows=rows) == 0 and policy.held.steps == policy.hold_steps - 1, "the choice stood"
    assert policy.choose(2, rows=(*rows, GenerationStats(16))) == 0 and policy.held.steps == policy.hold_steps
    assert policy.choose(1, rows=(GenerationStats(16),)) == 0 and policy.held.steps == policy.hold_steps, "new rows"
    for _ in range(40):
        policy.observe("step", 1, 4, costs[3], [3], drafted=3)  # a look's drafts, every one accepted
    assert policy.held is None
    assert policy.choose(1) > 0


def test_adaptive_verify_recovers_from_a_low_estimate_on_thin_evidence() -> None:
    """The demo pair at batch 1 (2 cores; a step verifying k drafts costs 1.0, 1.28, 1.27, 1.32 ... plain steps of
    24 ms): two hard prompts first drove the first draft's acceptance estimate to 0.08 on the floor's evidence
    while the traffic's is 0.32, which pays (1.12x plain). Looks at drafting must find that out within seconds of
    steps, not fade while they do: over 10 seeded runs, the median time to drafting as the steady choice is under
    10 s of steps, where the same policy without optimism (looks fading as soon as the choice stays) takes over 30."""
    costs = [0.0241 * r for r in (1.0, 1.282, 1.271, 1.315, 1.408, 1.528)] + [0.040 + 0.003 * k for k in range(10)]

    def seconds_to_drafting(look_optimism: float, seed: int, horizon: float = 60.0) -> float:
        rng = np.random.default_rng(seed)
        policy = AdaptiveVerify(16, StepCosts(), warmup_rows=0, look_optimism=look_optimism)
        for k, seconds in enumerate(costs):
            policy.costs.record(f"run{k}", 1, seconds)
        policy.reached[1:] = policy.evidence_floor
        policy.accepted[1], policy.accepted[2:] = 0.08 * policy.evidence_floor, 0.4 * policy.evidence_floor
        clock = 0.0
        while clock < horizon:
            k = policy.choose(1)
            if k and not policy.exploring and policy.chosen == k:
                return clock
            accepted = next((j for j in range(k) if rng.random() >= (0.32 if j == 0 else 0.4)), k)
            policy.observe("step" if k else "verify", 1, 1 + k, costs[k], [accepted], drafted=k)
            clock += costs[k]
        return horizon

    default = AdaptiveVerify(16).look_optimism
    assert default > 0
    assert np.median([seconds_to_drafting(default, seed) for seed in range(10)]) < 10.0
    assert np.median([seconds_to_drafting(0.0, seed) for seed in range(10)]) > 30.0


def test_generation_stats_count_each_draft_reached_and_accepted() -> None:
    """A draft is reached when it was verified and every draft before it accepted: the first rejected one is reached,
    those after it are not; a draft past what the step verified is never reached."""
    stats = GenerationStats(8)
    stats.record_step(verified=5, accept_len=2, emitted=3)  # drafts 1-2 accepted, 3 rejected, 4-5 not reached
    stats.record_step(verified=2, accept_len=2, emitted=3)  # both verified drafts accepted: nothing else reached
    stats.record_step(verified=0, accept_len=0, emitted=1)  # a plain step
    assert stats.position_reached_counts == [2, 2, 1, 0, 0, 0, 0]
    assert stats.position_accept_counts == [2, 2, 0, 0, 0, 0, 0]


def test_adaptive_verify_weighs_each_rows_own_acceptance() -> None:
    """The traffic's acceptance is a prior that a row's own drafts outweigh within a few steps: with the traffic
    accepting half of first drafts, a row that has rejected its last 12 decodes plainly and a new row drafts; in a
    batch of both, the expected tokens are their sum. Over requests that alternate between a drafter-friendly one
    (first drafts accepted 55% of the time) and a hard one (5%), simulated at the demo pair's step costs, weighing
    each row's own acceptance makes at least 3% more tokens per second than the traffic's estimate alone, which
    follows the requests ~200 steps late."""
    costs = [0.022 * (1.0 + (0.10 + 0.045 * (k - 1) if k else 0.0)) for k in range(16)]  # [16]: k drafts verified

    def policy_at_demo_costs() -> AdaptiveVerify:
        policy = AdaptiveVerify(16, StepCosts(), warmup_rows=0)
        for k, seconds in enumerate(costs):
            policy.costs.record(f"run{k}", 1, seconds)
        return policy

    policy = policy_at_demo_costs()
    policy.reached[1:], policy.accepted[1:] = 40.0, 20.0  # the traffic: each draft accepted half the times reached
    hard, new = GenerationStats(16), GenerationStats(16)
    for _ in range(12):
        hard.record_step(verified=3, accept_len=0, emitted=1)
    assert policy.choose(1, rows=(hard,)) == 0
    assert policy.choose(1, rows=(new,)) > 0
    assert policy.choose(1) > 0, "without rows: the traffic's estimate"
    both = policy.acceptance((hard, new))
    assert both == pytest.approx((policy.acceptance((hard,)) + policy.acceptance((new,))) / 2)

    def tokens_per_plain_second(weigh_rows: bool, seed: int) -> float:
        rng = np.random.default_rng(seed)
        policy, clock, tokens = policy_at_demo_costs(), 0.0, 0
        for request in range(10):
            first, later = (0.55, 0.6) if request % 2 == 0 else (0.05, 0.3)  # P(draft 1), P(draft j | 1..j-1 accepted)
            stats = GenerationStats(16)
            while sum(stats.acceptance_lengths) < 128:
                k = policy.choose(1, rows=(stats,) if weigh_rows else ())
                accepted = next((j for j in range(k) if rng.random() >= (first if j == 0 else later)), k)
                policy.observe("step" if k else "verify", 1, 1 + k, costs[k], [accepted], drafted=k)
                stats.record_step(k, accepted, accepted + 1)
                clock += costs[k]
            tokens += sum(stats.acceptance_lengths)
        return tokens * costs[0] / clock  # speedup over plain decoding at the same step costs

    seeds = range(6)
    rows = np.median([tokens_per_plain_second(True, seed) for seed in seeds])
    traffic = np.median([tokens_per_plain_second(False, seed) for seed in seeds])
    assert rows > 1.03 * traffic > 1.0


def test_adaptive_verify_looks_below_when_it_verifies_the_whole_block() -> None:
    """At k = block - 1 there is nothing above to look at: every look looks below."""
    policy = AdaptiveVerify(16, StepCosts(), explore_budget=1.0, warmup_rows=0)
    for k in range(16):
        policy.costs.record(f"run{k}", 1, 0.024 + 0.001 * k)
    policy.accepted[1:] = policy.reached[1:]  # every draft accepted
    chosen = []
    for _ in range(200):
        k = policy.choose(1)
        policy.observe("step", 1, 1 + k, 0.024 + 0.001 * k, [k], drafted=k)  # every draft accepted
        chosen.append(k)
    assert policy.looks >= 10 and set(chosen) == {13, 15}


def test_plain_decoding_calibrates_its_decode_shapes(engine: GraphEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain decoding, the benchmarks' baseline, runs its `decode` graph once at batch 1, 2, 4 ... up to the free
    slots before it is timed (as the adaptive policy calibrates its graphs), and hands every slot back."""
    calls: list[tuple[str, int]] = []
    run = engine.run
    monkeypatch.setattr(engine, "run", lambda graph, batch: calls.append((graph, batch.block.shape[0])) or run(graph, batch))
    free = engine.pool.free_slots
    PlainDecoding().calibrate(engine)
    expected = [1 << i for i in range(free.bit_length())]  # 1, 2, 4 ... <= free
    assert calls == [("decode", b) for b in expected]
    assert engine.pool.free_slots == free


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="reads resident memory from Linux's /proc")
def test_a_state_pool_holds_in_memory_only_the_rows_written() -> None:
    """A pool is allocated for every slot and position up front, but on the CPU its pages are committed as rows are
    written: 1 GiB of pool adds almost nothing to resident memory, reads zeros and keeps what is written."""
    spec = StateSpec("target_k", "positional", 8, (4096, 4, 64), "float32")  # 32 MiB per slot
    before = _resident_mib()
    pool = StatePool((spec,), 32)
    assert _resident_mib() - before < 64, "a 1 GiB pool committed up front"
    pool.write_rows("target_k", torch.tensor([5]), torch.tensor([[10, 11, 12]]), torch.ones(8, 1, 3, 4, 64))
    assert _resident_mib() - before < 64
    written = pool.tensors["target_k"][:, 5]  # [layers, positions, 4, 64]
    assert written[:, 10:13].eq(1).all() and written[:, 9].eq(0).all() and written[:, 13].eq(0).all()


def test_seeded_sampling_equals_plain_sampling_with_the_same_seed(engine: GraphEngine) -> None:
    """The uniform of generated token n is the seed's n-th draw, so DFlash draws what plain decoding draws."""
    sampling = SamplingParams(1.0, seed=7)
    prompt = [5, 35, 89, 4, 4]
    assert generate(engine, prompt, 40, sampling).tokens == generate_plain(engine, prompt, 40, sampling).tokens


def test_cancel_frees_the_slot_for_the_next_request(engine: GraphEngine) -> None:
    scheduler = Scheduler(engine)
    running = [Sequence([3, 4, 5], 200) for _ in range(SLOTS)]
    waiting = Sequence([9, 8, 7], 10)
    for sequence in [*running, waiting]:
        scheduler.submit(sequence)
    scheduler.step()
    assert engine.pool.free_slots == 0 and waiting in scheduler.waiting
    scheduler.cancel(running[1])
    assert engine.pool.free_slots == 1 and running[1].stats.finish_reason == "cancelled"
    scheduler.step()
    assert waiting in scheduler.active, "the freed slot went to the waiting request"
    for sequence in running:
        scheduler.cancel(sequence)
    while scheduler.busy:
        scheduler.step()
    assert waiting.tokens == generate(engine, waiting.prompt, 10).tokens
    assert engine.pool.free_slots == SLOTS


def test_a_bad_request_is_refused_and_the_batch_goes_on(engine: GraphEngine) -> None:
    scheduler = Scheduler(engine)
    good = Sequence([3, 4, 5], 20)
    scheduler.submit(good)
    scheduler.step()
    with pytest.raises(RequestError, match="top_p=0.0 is outside"):
        scheduler.submit(Sequence([3, 4], 5, SamplingParams(1.0, top_p=0.0)))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        scheduler.submit(Sequence([3, 400], 5))
    while scheduler.busy:
        scheduler.step()
    assert good.tokens == generate(engine, good.prompt, 20).tokens


def test_a_block_at_the_last_positions_reads_only_its_own_slot(tiny_targets: dict[str, Path], trained_drafter: Path) -> None:
    """Graphs read R + width rows of a slot (the past, then room for the block's keys). With max_seq_len 250 and
    blocks of 16 a slot has 266 rows, and the last position's past rounds up to 256 rows: the engine must read
    fewer, or the last layer's last slot would read past the pool (and other slots would read their neighbour's)."""
    pair = load_pair(tiny_targets["qwen3"], trained_drafter)
    small = torch_engine(*pair, max_seq_len=250, max_batch=1)
    assert small.spec.positions == 266 and small.block_size == 16
    prompt = [int(t) for t in torch.randint(0, small.vocab_size, (200,), generator=torch.Generator().manual_seed(3))]
    plain = generate_plain(small, prompt, max_new_tokens=50).tokens  # ends at position 249
    assert generate(small, prompt, max_new_tokens=50, policy=FixedVerify(small.block_size - 1)).tokens == plain
