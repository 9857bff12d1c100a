"""In-flight batching: admit sequences into pool slots, run one batched step for all of them, retire them at once.

Each `Scheduler.step()`:
1. admits waiting sequences while slots are free (prefill, joining the running batch; prompts admitted together
   with as many tokens left to prefill share one call); while others are generating, at most `prefill_chunk`
   prompt tokens per step, so a long prompt is prefilled in chunks over several steps (each continuing the slot's
   rows where the last ended) and no stream waits for a whole prompt's prefill between two of its tokens;
2. asks the verify policy how many drafted tokens to verify (k, the same for every row; 0 = plain decoding)
   and runs one graph call for every active sequence: `step` (verify 1 + k tokens, draft the next block) or, when
   the policy expects not to use drafts next time, its idle graph: `verify` (verify without drafting; the drafter's
   context still grows) or `decode` (the target alone, as plain decoding). A sequence whose drafter context
   `decode` steps left behind catches up before it drafts again: one prefill-graph call recomputes the rows of its
   tokens since (`GraphEngine.catch_up`), emitting its next token and a whole draft block;
3. commits each row's tokens (`Sequence.commit`), and retires finished and cancelled sequences (slot freed).

Outputs are exact whatever k is: the target's own choice decides every emitted token, and a sequence's
uniforms are indexed by generated-token number, not by step.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from dflash_trt.runtime.engine import GraphEngine, PrefillRow, StepBatch, StepResult
from dflash_trt.runtime.graph_io import WRITES
from dflash_trt.runtime.loop import GREEDY, GenerationStats, Sequence
from dflash_trt.runtime.sampling import SamplingTensors

CALIBRATED_DRAFTS = 3  # above batch 1, `AdaptiveVerify.calibrate` times steps of 1 .. this many drafts
LOOKUP_LIMIT = 4  # lookup drafts a row verifies at most (`AdaptiveVerify.lookup_drafts`)
PREFILL_CHUNK = 128  # serving's prompt tokens prefilled between two steps while others generate (see Scheduler)


class VerifyPolicy(Protocol):
    """Chooses how many drafted tokens each batched step verifies, and learns from what steps cost and accept."""

    graph_when_idle: str  # the graph that runs when `choose` returns 0: "verify" (keeps the drafter's context) or "decode"
    lookup_limit: int  # lookup drafts a row may verify on a step verifying none of the drafter's (0: no lookup drafts at all)

    def choose(self, batch: int, behind: int = 0, rows: tuple[GenerationStats, ...] = (), left: float = np.inf) -> int:
        """Drafts to verify per row in a step of `batch` rows (0 = none); `behind`: tokens whose drafter context the
        rows lack (after `decode` steps), which a step that drafts first recomputes (`Scheduler._catch_up`); `rows`:
        the rows' statistics so far (what their own drafts achieved), where known; `left`: tokens the rows may still
        generate, on average (max_tokens less what they have)."""
        ...

    def lookup_drafts(self, graph: str, batch: int, available: list[int]) -> int:
        """Lookup drafts (`runtime.lookup`) to verify per row in a step of `graph` that verifies none of the drafter's,
        the rows having `available` each (0: none)."""
        ...

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
        """A graph call of `batch` rows verifying `width` tokens each (and drafting `drafted`) took `seconds`;
        `looked_up`: the lookup drafts each row verified, where the call verified those."""


class StaticPolicy:
    """A policy whose choices do not depend on what steps cost or accept (nothing to observe), with no lookup drafts."""

    lookup_limit = 0

    def lookup_drafts(self, graph: str, batch: int, available: list[int]) -> int:
        return 0

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
        pass


@dataclass
class FixedVerify(StaticPolicy):
    """Always verify `drafts` drafted tokens (block_size - 1: the whole block)."""

    drafts: int
    graph_when_idle: str = "verify"

    def choose(self, batch: int, behind: int = 0, rows: tuple[GenerationStats, ...] = (), left: float = np.inf) -> int:
        return self.drafts


@dataclass
class PlainDecoding(StaticPolicy):
    """No drafting at all: the `decode` graph, one token per step (the baseline on the same engine)."""

    graph_when_idle: str = "decode"

    def choose(self, batch: int, behind: int = 0, rows: tuple[GenerationStats, ...] = (), left: float = np.inf) -> int:
        return 0

    def calibrate(self, engine: GraphEngine, context: int = 256) -> None:
        """Run the `decode` graph once at batch 1, 2, 4 ... (up to the free slots): the shapes a load then uses have
        been planned once, as `AdaptiveVerify.calibrate` does for its graphs, so a benchmark times neither mode's
        first calls."""
        start = min(context, engine.max_seq_len // 2)
        for batch in calibration_batches(engine, engine.pool.free_slots):
            time_call(engine, "decode", batch, 1, 1, start, repeats=0)  # untimed: its first call plans the shape


@dataclass
class StepCosts:
    """Measured seconds per graph call, by graph and tokens in the call (batch x verify width), as moving averages;
    sizes not measured yet are interpolated between measured ones (linearly in tokens, proportional above)."""

    decay: float = 0.8  # weight of the old average
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)

    def record(self, graph: str, tokens: int, seconds: float) -> None:
        table = self.seconds.setdefault(graph, {})
        old = table.get(tokens)
        table[tokens] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def estimate(self, graph: str, tokens: int) -> float | None:
        table = self.seconds.get(graph)
        if not table:
            return None
        if tokens in table:
            return table[tokens]
        sizes = sorted(table)
        at = bisect.bisect_left(sizes, tokens)
        if at == 0:
            return table[sizes[0]]
        if at == len(sizes):
            return table[sizes[-1]] * tokens / sizes[-1]
        low, high = sizes[at - 1], sizes[at]
        share = (tokens - low) / (high - low)
        return table[low] + share * (table[high] - table[low])


@dataclass
class PlainHold:
    """A plain-decoding choice of `AdaptiveVerify` that stands while the batch holds the same rows, for at most
    `steps` more steps and until the seconds of steps since the last look reach `next_look`."""

    batch: int
    rows: tuple[GenerationStats, ...]
    next_look: float
    steps: int

    def stands(self, batch: int, rows: tuple[GenerationStats, ...], since_look: float) -> bool:
        """Whether the choice stands for this step (counted if so)."""
        if self.steps == 0 or since_look >= self.next_look or batch != self.batch or len(rows) != len(self.rows):
            return False
        if any(row is not held for row, held in zip(rows, self.rows, strict=True)):
            return False
        self.steps -= 1
        return True


@dataclass
class AdaptiveVerify:
    """Verify the k that maximises expected tokens per second for the batch at hand:
    sum over rows of (1 + sum_{j<=k} P(drafts 1..j accepted)) / cost(batch, k), from measured step costs and measured
    per-position acceptance: the traffic's, weighed with each row's own drafts so far (`acceptance`), so a request the
    drafter does not know decodes plainly beside those it drafts well (k = 0 when drafting does not pay, e.g. poor
    acceptance at a large batch). From plain decoding, drafting is switched back on only for a gain of at least
    `switch_on_margin` (see `_best`).

    Until drafts of `warmup_rows` rows have been verified, the policy verifies the k that would be best if every
    draft were accepted, among steps that cost at most `warmup_cost_limit` steps verifying none: acceptance is
    measured before it is weighed (calibration measures costs, not acceptance, and the prior alone caps expected
    tokens per step at 2, which on a model whose drafter costs as much as its target would choose plain decoding
    for good and never see a draft accepted). Warm-up counts rows, not steps: acceptance does not depend on the
    batch, and a step of 16 rows measures what 16 steps of one do (on the demo pair, 2 cores, a whole-block step of
    16 rows cost 4.7 plain steps).

    Acceptance at position j is only observed when j drafts are verified, and a step's cost only when such a
    step runs. To keep both current, the policy now and then looks `explore_extra` drafts beyond the chosen k
    (two steps: one that drafts them, one that verifies them) or, every other time, below it, but only once
    the steps since the last look have cost `explore_budget` times what the look costs: exploring stays within
    about 1/explore_budget of the time. Every look made at a batch size since its choice became what it is doubles
    that budget there, up to `2**quiet_looks_limit` times: where drafting never pays (a code drafter on chat
    traffic) looks fade from ~1% of the time to under 0.1%; once the choice changes, they are as frequent as at first.
    Looks do not fade while plain decoding is chosen on evidence too thin to rule drafting out (`_quiet_looks`).

    Plain steps run `verify`, which keeps the drafter's context, while drafting might pay soon; once it is ruled out
    (it would not pay even with the first draft's acceptance read `decode_optimism` standard errors higher, or at
    this batch size whatever the drafter guesses), they run `decode`, the cheaper plain step (on the demo pair, 2
    cores, `verify` costs 2-4% more at one row), if the engine can catch a sequence's drafter context up
    (`can_catch_up`: no recurrent states). A look from there first recomputes the rows the sequences lack: its
    cost, counted in the look's spacing, grows with the tokens `behind`, so looks come rarely where they cost most.

    A plain-decoding choice stands (`PlainHold`) for up to `hold_steps` steps of the same rows, until a look is due:
    a plain step observes no draft, so what decided it moves only by evidence decaying and costs drifting. Deciding
    anew every step cost ~0.3 ms of host time per step (cold caches after each graph call; on the demo pair, 2 cores,
    MT-Bench, 20 prompts x 128 tokens: 0.78 s of a 93 s run; held, 0.09 s).
    """

    block_size: int
    costs: StepCosts = field(default_factory=StepCosts)
    explore_extra: int = 2
    explore_budget: float = 100.0
    quiet_looks_limit: int = 4  # at most this many doublings of explore_budget
    decay: float = 0.995  # per observed step: acceptance estimates follow the traffic (about 200 steps)
    evidence_floor: float = 8.0  # observations per position that decay leaves (see _learn_acceptance)
    switch_on_margin: float = 0.05  # from plain decoding, drafting must promise this much more (see choose)
    look_optimism: float = 2.5  # standard errors: looks do not fade while this much optimism would draft (_quiet_looks)
    row_prior: float = 4.0  # a row's own observations the traffic's acceptance weighs as (see acceptance)
    warmup_rows: int = 8  # rows of drafting steps before the policy weighs acceptance
    warmup_cost_limit: float = 3.0  # a warm-up step costs at most this many steps that verify no draft
    can_catch_up: bool = False  # plain steps may run `decode` (GraphEngine.catch_up restores the drafter's context)
    decode_optimism: float = 1.0  # standard errors: plain steps run `decode` when even this much optimism would not draft
    graph_when_idle: str = "verify"  # set by `choose`: "decode" where drafting is ruled out (and can_catch_up)
    reached: np.ndarray = field(init=False)  # [B]: steps that verified draft j with drafts 1..j-1 accepted (0 unused)
    accepted: np.ndarray = field(init=False)  # [B]: of those, steps that accepted draft j too
    unfaded_steps: int = 0  # steps observed whose decay `reached` and `accepted` do not show yet (see _fade)
    since_look: float = 0.0  # seconds of steps since the last exploration
    exploring: int = 0  # steps left of the current exploration
    looking_at: int = 0  # the k the current exploration drafts and then verifies
    looks: int = 0  # explorations so far (odd ones look below the chosen k)
    quiet_looks: dict[int, tuple[int, int]] = field(default_factory=dict)  # batch -> (k chosen, looks since)
    drafted_rows: int = 0  # rows of the steps that verified at least one draft
    shapes_run: set[tuple[str, int, int, int]] = field(default_factory=set)  # (graph, batch, width, drafted) seen
    chosen: int = 0  # the last k chosen other than by a look
    hold_steps: int = 16  # steps a plain-decoding choice stands unchanged (0: decide every step)
    held: PlainHold | None = None  # the plain-decoding choice standing now
    lookup_limit: int = LOOKUP_LIMIT  # lookup drafts a row verifies at most, on steps verifying none of the drafter's
    lookup_margin: float = 0.02  # lookup drafts are verified only where they promise this much more than none
    lookup_reached: np.ndarray = field(init=False)  # [lookup_limit + 1]: as `reached`, for lookup drafts
    lookup_accepted: np.ndarray = field(init=False)  # [lookup_limit + 1]: as `accepted`, for lookup drafts

    @classmethod
    def calibrated(cls, engine: GraphEngine, lookup_limit: int = LOOKUP_LIMIT) -> AdaptiveVerify:
        """The policy `dflash-serve` runs on `engine`, calibrated; plain steps on `decode` where drafting is ruled out,
        except on targets with recurrent states, where only `verify` keeps the drafter's context (`GraphEngine.catch_up`)."""
        policy = cls(engine.block_size, can_catch_up=not engine.recurrent, lookup_limit=lookup_limit)
        policy.calibrate(engine)
        return policy

    def __post_init__(self) -> None:
        self.reached = np.ones(self.block_size)  # a weak prior: each draft accepted half the times it is reached
        self.accepted = np.full(self.block_size, 0.5)
        self.lookup_reached = np.ones(self.lookup_limit + 1)
        self.lookup_accepted = np.full(self.lookup_limit + 1, 0.5)

    def acceptance(self, rows: tuple[GenerationStats, ...] = ()) -> np.ndarray:
        """[B]: P(drafts 1..j all accepted) for j = 0..B-1 (j = 0: 1), the product of each draft's acceptance
        once the drafts before it were accepted: a draft never reached keeps the prior's one half, so what lies past
        the observed drafts is worth less and less, never as much as the last observed one.

        That is the traffic's; with `rows`, the mean over the rows of each row's own, its drafts' acceptance so far
        with the traffic's weighing as `row_prior` of its observations: acceptance depends on the request (on the demo
        pair, HumanEval prompt 2 accepts a first draft ~0.2 of the time where its neighbours accept ~0.5), and a
        request's own steps tell within a few steps what the traffic's estimate, which follows requests over ~200
        steps, would tell after the request has ended."""
        self._fade()
        traffic = np.clip(self.accepted / self.reached, 0.0, 1.0)  # [B]: draft j's acceptance, drafts before accepted
        if rows:
            reached = np.array([[0, *stats.position_reached_counts] for stats in rows])  # [R, B]
            accepted = np.array([[0, *stats.position_accept_counts] for stats in rows])  # [R, B]
            conditional = (self.row_prior * traffic + accepted) / (self.row_prior + reached)  # [R, B]
        else:
            conditional = traffic[None].copy()  # [1, B]
        conditional[:, 0] = 1.0
        return np.cumprod(conditional, axis=1).mean(axis=0)

    def step_cost(self, batch: int, drafts: int) -> float | None:
        """Seconds of a step verifying `drafts` per row and drafting as many for the next one: as measured on steps
        of that kind (`run{k}`) at this batch size or between two measured ones, scaled by how the plain step's cost
        has moved since (`_plain_drift`); else from its parts (verify by tokens + drafting by the block slots it
        denoises, batch x (1 + drafts)): per-row costs fall with the batch, so a larger batch is never extrapolated
        from a smaller one's steps."""
        return self._step_cost(batch, drafts, self._step_cost(batch, 0, None) if drafts else None)

    def _step_cost(self, batch: int, drafts: int, plain: float | None) -> float | None:
        """`step_cost`, given the plain step's cost at this batch size now (None for the plain step itself), which
        every k's drift needs: worked out once per choice, not once per k."""
        runs = self.costs.seconds.get(f"run{drafts}", {})
        if batch in runs or (runs and min(runs) < batch < max(runs)):
            measured = self.costs.estimate(f"run{drafts}", batch)
            return None if measured is None else measured * self._plain_drift(batch, f"run{drafts}", plain)
        verify = self.costs.estimate("verify", batch * (drafts + 1))
        if drafts == 0 or verify is None:
            return verify
        draft = self.costs.estimate("draft", batch * (drafts + 1))
        return None if draft is None else verify + draft

    def _plain_drift(self, batch: int, shape: str, now: float | None) -> float:
        """How the plain step's cost at this batch size (measured by nearly every step where drafting does not pay;
        `now`) has moved since steps of `shape` (a cost table: `run{k}`, or `{graph}@{width}` for lookup drafts) were
        timed here: now / then (1 where `shape` is the plain step or was never timed). Costs of a shape rarely run are
        scaled by it, so a comparison with the plain step is between costs of one moment: a plain step whose context
        has grown, or that ran in a slow minute, is not weighed against a wider step timed at calibration (at batch
        16 on the demo pair, 2 cores, that made a 1-draft step read 1.42 plain steps where it cost 1.5-1.6; in session
        52, a `decode` of 1 + 1 lookup draft timed at calibration read 1.31 plain steps where it cost 1.56: the
        calibration's rows all start at one position, a batch's rows read the past of its longest)."""
        then = self.costs.estimate(f"plain_when_{shape}", batch)
        return 1.0 if not then or now is None else now / then

    def optimistic(self, acceptance: np.ndarray, errors: float) -> np.ndarray:
        """[B]: `acceptance` (from `acceptance()`) with the first draft's acceptance read `errors` standard errors
        above its mean (the standard error of the traffic's estimate, whose evidence after decay it counts)."""
        self._fade()
        first = acceptance[1]
        raised = min(first + errors * np.sqrt(first * (1.0 - first) / self.reached[1]), 1.0)
        optimistic = acceptance.copy()
        optimistic[1:] *= raised / first if first > 0 else 1.0  # every later draft is reached through the first
        return optimistic

    def expected_rates(self, batch: int) -> np.ndarray:
        """[B]: expected tokens per second for k = 0 .. B-1 drafts verified per row (nan where a cost is unknown)."""
        return _rates(batch, self.acceptance(), self._step_costs(batch))

    def _step_costs(self, batch: int) -> np.ndarray:
        """[B]: `step_cost` for k = 0 .. B-1 (nan where unknown)."""
        plain = self._step_cost(batch, 0, None)
        costs = (plain, *(self._step_cost(batch, k, plain) for k in range(1, self.block_size)))
        return np.array([np.nan if c is None else c for c in costs])

    def warmup_drafts(self, batch: int) -> int:
        """Drafts to verify while acceptance is unmeasured: the k that maximises tokens per second if every draft is
        accepted, among steps costing at most `warmup_cost_limit` steps that verify none (0: measuring here costs
        too much, or drafting cannot pay at this batch whatever the drafter guesses); the whole block where a cost
        is not known yet."""
        costs = self._step_costs(batch)
        if np.isnan(costs).any():
            return self.block_size - 1
        affordable = [(1 + k) / max(c, 1e-9) if c <= self.warmup_cost_limit * costs[0] else 0.0 for k, c in enumerate(costs)]
        return int(np.argmax(affordable))

    def choose(self, batch: int, behind: int = 0, rows: tuple[GenerationStats, ...] = (), left: float = np.inf) -> int:
        if self.drafted_rows < self.warmup_rows:
            self.chosen = self.warmup_drafts(batch)  # acceptance not measured yet: verify what could pay, and measure
            self._idle_on("decode" if self.chosen == 0 else "verify")  # 0: no draft could pay at this batch
            return self.chosen
        if self.exploring:
            self.exploring -= 1
            return self.looking_at  # a look's second step verifies what its first drafted
        if self.held is not None and self.held.stands(batch, rows, self.since_look):
            return 0
        self.held = None
        costs = self._step_costs(batch)
        if np.isnan(costs).any():
            self.chosen = self.block_size - 1  # a cost not measured yet: verify everything and measure
            return self.chosen
        acceptance = self.acceptance(rows)
        best = self._best(_rates(batch, acceptance, costs))
        if best and behind and not self._catch_up_pays(best, costs, acceptance, behind, left):
            best = 0
        ruled_out = best == 0 and self._best(_rates(batch, self.optimistic(acceptance, self.decode_optimism), costs)) == 0
        self._idle_on("decode" if ruled_out else "verify")
        around = [min(best + self.explore_extra, self.block_size - 1), max(best - self.explore_extra, 0)]  # above, below
        if self.looks % 2 == 1:
            around.reverse()  # odd looks look below first
        look = next((k for k in around if k != best), best)
        extra = abs(costs[look] - costs[best]) + (self._catch_up_cost(behind, costs[0]) if best == 0 else 0.0)
        spacing = 2 * self.explore_budget * extra  # seconds of steps between looks, at first
        next_look = spacing if look != best else np.inf  # since_look at which a look may come
        if look != best and self.since_look >= spacing:
            quiet = self._quiet_looks(batch, best, costs, acceptance)
            next_look = spacing * 2 ** min(quiet, self.quiet_looks_limit)
            if self.since_look >= next_look:
                self.since_look, self.exploring, self.looks, self.looking_at = 0.0, 1, self.looks + 1, look
                self.quiet_looks[batch] = (best, quiet + 1)
                return look
        self.chosen = best
        if best == 0 and self.hold_steps:
            self.held = PlainHold(batch, rows, next_look, self.hold_steps)
        return best

    def lookup_drafts(self, graph: str, batch: int, available: list[int]) -> int:
        """The e <= `lookup_limit` that maximises expected tokens per second of a `graph` step verifying e lookup drafts
        per row (a row with fewer verifies what it has, the rest of its block padding): the rows' tokens, each
        1 + the expected accepted of its drafts (their measured per-position acceptance, as `acceptance` does it
        for the drafter's), over the step's measured cost at this batch and width (scaled by how the plain step's
        cost has moved since, `_plain_drift`); 0 unless that beats verifying none by `lookup_margin`, or where a cost
        is not measured. On the demo pair (2 cores, batch 1), a `decode` of 5 tokens cost 1.09 of one token's, of 3
        tokens 1.04; at 16 rows 3.3 and 2.0."""
        most = min(self.lookup_limit, max(available, default=0))
        none = self.costs.estimate(f"{graph}@1", batch)
        if not most or none is None:
            return 0
        conditional = np.clip(self.lookup_accepted / self.lookup_reached, 0.0, 1.0)
        conditional[0] = 1.0
        expected = np.cumsum(np.cumprod(conditional)) - 1.0  # [limit + 1]: accepted drafts of e verified
        best, best_rate = 0, batch / none * (1 + self.lookup_margin)
        for extra in range(1, most + 1):
            shape = f"{graph}@{1 + extra}"
            cost = self.costs.estimate(shape, batch)
            if cost is None:
                break
            cost *= self._plain_drift(batch, shape, none)
            tokens = batch + sum(expected[min(extra, have)] for have in available)
            if tokens / cost > best_rate:
                best, best_rate = extra, tokens / cost
        return best

    def _idle_on(self, graph: str) -> None:
        """Plain steps run `graph` from now on ("decode" only where the engine can catch the drafter's context up)."""
        self.graph_when_idle = graph if self.can_catch_up else "verify"

    def _catch_up_cost(self, behind: int, plain_step: float) -> float:
        """Seconds a look from plain decoding spends recomputing `behind` tokens' rows (as catch-ups cost so far, else
        as a verify of as many tokens), beyond the plain step whose token the catch-up gives."""
        if not behind:
            return 0.0
        measured = self.costs.estimate("catch_up", behind) or self.costs.estimate("verify", behind)
        return 0.0 if measured is None else max(measured - plain_step, 0.0)

    def _catch_up_pays(self, k: int, costs: np.ndarray, acceptance: np.ndarray, behind: int, left: float) -> bool:
        """Whether drafting k per step, over the `left` tokens the rows have left, saves more than recomputing the
        `behind` tokens' drafter rows first costs: a row lagging 100 tokens with 20 to go decodes them plainly (on the
        demo pair at 16 rows, 2 cores, a catch-up of 103 tokens took 1.85 s, 3% of a 55 s run)."""
        saved_per_token = costs[0] - costs[k] / np.cumsum(acceptance)[k]  # seconds of a step, per token per row
        return left * saved_per_token > self._catch_up_cost(behind, costs[0])

    def _quiet_looks(self, batch: int, best: int, costs: np.ndarray, acceptance: np.ndarray) -> int:
        """Looks made at this batch size since its choice became `best`, which space the next look out; none while
        plain decoding is chosen on thin evidence: if the first draft's acceptance read `look_optimism` standard
        errors higher would switch drafting on, looks stay as frequent as at first. On the demo pair at batch 1
        (2 cores, HumanEval), two hard prompts first drove that estimate to 0.08 where the run's truth is 0.30-0.33;
        with the spacing doubled after every look, the looks that would correct it came minutes apart. Only plain
        decoding needs this: a step that drafts observes the first draft in every row, so its evidence stays fresh."""
        chosen, looked = self.quiet_looks.get(batch, (best, 0))
        if chosen != best or looked == 0:
            return 0
        if best == 0 and self._best(_rates(batch, self.optimistic(acceptance, self.look_optimism), costs)) != 0:
            return 0
        return looked

    def _best(self, rates: np.ndarray) -> int:
        """The k of the highest expected rate; but from plain decoding (k = 0 chosen last), drafting only when it
        promises `switch_on_margin` more: its first step drafts and verifies nothing, which the steady rates leave
        out, and near break-even one lucky look (or the measured costs' noise) turns drafting on for steps that do
        not pay. On the demo pair at 4 rows (2 cores, 20 HumanEval requests x 128 tokens, 4 interleaved rounds):
        0.966x plain decoding without the margin, 0.986x with 5%."""
        best = int(np.argmax(rates))
        if self.chosen == 0 and rates[best] < rates[0] * (1 + self.switch_on_margin):
            return 0
        return best

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
        self.since_look += seconds
        if graph == "catch_up":  # recomputed rows, by the tokens recomputed (a new shape nearly every time)
            self.costs.record("catch_up", batch * width, seconds)
            return
        if looked_up is not None:
            self.unfaded_steps += 1  # verified none of the drafter's drafts
            self._learn_lookup(accept_lens, looked_up)
        else:
            self._learn_acceptance(width, accept_lens)
            if width > 1:
                self.held = None  # drafts observed: decide anew
        shape = (graph, batch, width, drafted)
        if shape not in self.shapes_run:  # a shape's first call also plans its memory: not what the shape costs
            self.shapes_run.add(shape)
            return
        self._record_cost(graph, batch, width, seconds, drafted)

    def _record_cost(self, graph: str, batch: int, width: int, seconds: float, drafted: int) -> None:
        if drafted == width - 1:  # a steady step (verified k, drafted k): its cost as it is, and the plain step's then
            plain = self.step_cost(batch, 0) if drafted else None
            if plain is not None:
                self.costs.record(f"plain_when_run{drafted}", batch, plain)
            self.costs.record(f"run{drafted}", batch, seconds)
        if graph in ("verify", "decode"):  # by batch, per width: what lookup drafts weigh, and the plain step's then
            plain = self.costs.estimate(f"{graph}@1", batch) if width > 1 else None
            if plain is not None:
                self.costs.record(f"plain_when_{graph}@{width}", batch, plain)
            self.costs.record(f"{graph}@{width}", batch, seconds)
        if graph == "verify":
            self.costs.record("verify", batch * width, seconds)
        elif graph == "step":  # what it cost beyond verifying is the drafter's, by the block slots it denoised
            verify = self.costs.estimate("verify", batch * width)
            if verify is not None:
                self.costs.record("draft", batch * (1 + drafted), max(seconds - verify, 0.0))

    def _learn_acceptance(self, width: int, accept_lens: list[int]) -> None:
        """Count what a step verified and accepted. Old observations decay by `decay` a step, but never below
        `evidence_floor` per position: a long run of plain steps keeps what was learned before it, and one lucky look
        then weighs one in nine, not all there is. A plain step only counts towards the decay (`_fade` applies it
        when the counts are next read)."""
        self.unfaded_steps += 1
        if width == 1:
            return  # a plain step verified no draft
        self._fade()
        self.drafted_rows += len(accept_lens)
        for accept_len in accept_lens:
            _count_drafts(self.reached, self.accepted, accept_len, width - 1)

    def _learn_lookup(self, accept_lens: list[int], looked_up: list[int]) -> None:
        """Count what a step's lookup drafts reached and had accepted (rows that had none count nothing); the counts
        decay by `decay` per step that verified lookup drafts, down to `evidence_floor` per position."""
        _decay_counts(self.lookup_reached, self.lookup_accepted, self.decay, self.evidence_floor)
        for accept_len, have in zip(accept_lens, looked_up, strict=True):
            _count_drafts(self.lookup_reached, self.lookup_accepted, accept_len, have)

    def _fade(self) -> None:
        """Decay the counts by the `unfaded_steps` steps observed since they were last faded: per position, what as
        many steps of decay by `decay` leave, down to `evidence_floor` (counts at or under it stay)."""
        if not self.unfaded_steps:
            return
        _decay_counts(self.reached, self.accepted, self.decay**self.unfaded_steps, self.evidence_floor)
        self.unfaded_steps = 0

    def calibrate(self, engine: GraphEngine, max_tokens: int = 256, context: int = 256) -> None:
        """Time, on free slots with throw-away rows at `context` positions (at most half the engine's length): at
        batch 1, the step for every k (verify k drafts, draft k); at batch 2, 4 ..., the step for the first
        `CALIBRATED_DRAFTS` k; at every batch, the verify graph at 1 and B tokens per row and drafting. The first
        choices are then informed, and every batch-1 shape has run once; live steps measure the steps they run.
        The few-draft steps are timed at every batch because costs from parts mislead there: a 2-token verify of 16
        rows reads 16 contexts, and the 32-token calls the parts were timed at read one or two."""
        drafts = engine.block_size - 1
        start = min(context, engine.max_seq_len // 2)
        for batch in calibration_batches(engine, max_tokens):
            for width in (1, engine.block_size):  # the plain step (width 1) first: the steps below are scaled by it
                if batch * width <= max_tokens:
                    self._calibrated("verify", batch, width, 0, time_call(engine, "verify", batch, width, drafts, start))
            most = drafts if batch == 1 else CALIBRATED_DRAFTS
            for k in range(1, most + 1):
                if batch * (k + 1) <= max_tokens:
                    self._calibrated("step", batch, k + 1, k, time_call(engine, "step", batch, k + 1, k, start))
            if batch * engine.block_size <= max_tokens:
                self._calibrated("step", batch, 1, drafts, time_call(engine, "step", batch, 1, drafts, start))
            for graph in ("verify", "decode") if self.lookup_limit else ():  # what lookup drafts weigh (width 1: none)
                for width in range(1, min(self.lookup_limit + 1, engine.block_size) + 1):
                    if (graph, batch, width, 0) not in self.shapes_run:  # (verify at width 1 is timed above)
                        self._calibrated(graph, batch, width, 0, time_call(engine, graph, batch, width, 0, start))

    def _calibrated(self, graph: str, batch: int, width: int, drafted: int, seconds: float) -> None:
        """A timed call of a shape that has run before (`time_call` warms it up): its cost as it is."""
        self.shapes_run.add((graph, batch, width, drafted))
        self._record_cost(graph, batch, width, seconds, drafted)


def _count_drafts(reached: np.ndarray, accepted: np.ndarray, accept_len: int, verified: int) -> None:
    """In place, one row of a step that verified `verified` drafts and accepted `accept_len` (a padding slot can
    match too; only the first `verified` count): drafts 1..accept_len+1 were reached, 1..accept_len accepted."""
    reached[1 : min(accept_len + 2, verified + 1)] += 1
    accepted[1 : min(accept_len, verified) + 1] += 1


def _decay_counts(reached: np.ndarray, accepted: np.ndarray, factor: float, floor: float) -> None:
    """In place, per position: both counts times `factor`, but the reached count not below `floor` (at or under it,
    they stay)."""
    floor_share = floor / reached  # [B]
    fading = np.where(floor_share < 1.0, np.maximum(factor, floor_share), 1.0)  # [B]
    reached *= fading
    accepted *= fading


def _rates(batch: int, acceptance: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """[B]: expected tokens per second for k = 0 .. B-1 drafts verified per row, from P(drafts 1..k accepted) and the
    steps' seconds (nan where a cost is unknown)."""
    return batch * np.cumsum(acceptance) / np.maximum(costs, 1e-9)  # [B] tokens per step / [B] seconds


def calibration_batches(engine: GraphEngine, limit: int) -> list[int]:
    """Batch sizes 1, 2, 4 ... up to the engine's free slots and `limit`: what the policies' calibrations run."""
    top = min(engine.pool.free_slots, limit)
    return [1 << i for i in range(top.bit_length())]


def time_call(engine: GraphEngine, graph: str, batch: int, width: int, drafts: int, start: int, repeats: int = 3) -> float:
    """Seconds of one call on throw-away rows of the first free slots at positions `start`.. (stale rows: nothing is
    kept, and attention over them costs what it costs over real ones): the best of `repeats` calls after an untimed
    first one (`repeats` = 0: the first call only, to plan the shape; inf)."""
    held = [engine.pool.acquire() for _ in range(batch)]
    try:
        call = StepBatch(
            slots=torch.tensor(held),
            block=torch.zeros(batch, width, dtype=torch.long),
            start=torch.full((batch,), start, dtype=torch.long),
            uniforms=torch.zeros(batch, width),
            sampling=SamplingTensors.of([GREEDY] * batch, engine.vocab_size),
            drafts=drafts,
        )
        engine.run(graph, call)  # a new shape: the runner plans its memory on the first call
        best = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            engine.run(graph, call)
            best = min(best, time.perf_counter() - began)
        return best
    finally:
        for slot in held:
            engine.pool.release(slot)


class Scheduler:
    """Sequences in, one batched step at a time; see the module docstring."""

    def __init__(
        self, engine: GraphEngine, policy: VerifyPolicy | None = None, max_active: int | None = None, prefill_chunk: int = 0
    ) -> None:
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={prefill_chunk}: give the prompt tokens to prefill per step, or 0 for whole prompts")
        self.engine = engine
        self.max_active = max_active or engine.pool.slots  # 1: serve one request at a time
        self.prefill_chunk = prefill_chunk  # prompt tokens prefilled per step while others generate; 0: whole prompts
        self.policy: VerifyPolicy = policy or FixedVerify(engine.block_size - 1)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.last_width = 0  # verify width of the last batched step (1 + drafts); 0: no batched step ran
        self.last_batch = 0  # rows of the last batched step
        self.last_graph_seconds = 0.0  # its graph call
        self.last_prefill_seconds = 0.0  # prefills of the sequences admitted in the same step()

    def submit(self, sequence: Sequence) -> None:
        """Validate (raises RequestError with the reason) and queue for admission."""
        if sequence.stats.block_size != self.engine.block_size:
            sequence.stats = GenerationStats(self.engine.block_size)
        sequence.validate(self.engine)
        self.waiting.append(sequence)

    def cancel(self, sequence: Sequence) -> None:
        """Stop a sequence now: it leaves the queue or the batch and its slot is freed."""
        sequence.stats.finish_reason = "cancelled"
        sequence.finished = True
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        elif sequence in self.active:
            self._retire(sequence)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Admit, run one batched step, commit, retire: each sequence once, with the tokens it emitted (possibly
        none). A sequence admitted here emits at its prefill and again in the batched step: one entry with both, so
        a consumer that ends a request when its sequence is finished sees every token first."""
        self.last_batch = self.last_width = 0
        self.last_graph_seconds = self.last_prefill_seconds = 0.0
        emitted = self._admit()
        if self.active:
            emitted += self._batched_step()
        for sequence in [s for s in self.active if s.finished]:
            self._retire(sequence)
        return _by_sequence(emitted)

    def _admit(self) -> list[tuple[Sequence, list[int]]]:
        """Prefill: first the rest of a prompt prefilled in part, then waiting prompts in free slots, within this
        step's budget of prompt tokens (`prefill_chunk` while others generate, else unlimited). Once a chunk has run,
        a waiting prompt starts only if all of it fits in what is left: split there, its first chunk would be an
        extra graph call for a prompt that completes in the next step either way. Prompts admitted one after another
        with as many tokens left to prefill run in one call (`_group_takes`)."""
        emitted: list[tuple[Sequence, list[int]]] = []
        budget = self.prefill_chunk if self.prefill_chunk and self._generating() else sys.maxsize
        fitting: int | None = None  # once a chunk has run: the most prompt tokens a waiting prompt may have left
        partial = next((s for s in self.active if not s.prefilled), None)
        if partial is not None:
            chunk = partial.prompt[partial.prefill_end : partial.prefill_end + budget]
            emitted += self._prefill([(partial, chunk)])
            budget = fitting = budget - len(chunk)
        group: list[tuple[Sequence, list[int]]] = []  # admitted, not yet prefilled: (sequence, its chunk), one call
        while budget > 0 and self._can_admit():
            head = self.waiting[0]
            if group or fitting is not None:  # (else nothing depends on what it has left: not looked up)
                left = len(head.prompt) - self.engine.reusable(head.prompt, head.prefix_scope)
                if group and not self._group_takes(group, head, left):
                    emitted += self._prefill(group)
                    group = []
                    continue  # the group's rows may shorten what `head` has left
                if fitting is not None and left > fitting:
                    break
            sequence = self._take_waiting()
            chunk = sequence.prompt[sequence.prefill_end : sequence.prefill_end + budget]
            group.append((sequence, chunk))
            budget -= len(chunk)
            fitting = budget
        if group:
            emitted += self._prefill(group)
        return emitted

    def _group_takes(self, group: list[tuple[Sequence, list[int]]], head: Sequence, left: int) -> bool:
        """Whether `head` (with `left` prompt tokens to prefill) joins the group's call: as many tokens left as each
        of them, and no prompt of the group shares more of its prompt than a slot holds now (it waits for their rows,
        to reuse them as if each prompt had been prefilled alone)."""
        if left != len(group[0][1]):
            return False
        reused = len(head.prompt) - left
        earlier = {tuple(s.prompt) for s, _ in group if s.prefix_scope == head.prefix_scope}  # (often one prompt many times)
        return not any(self.engine.reusable_after(prompt, head.prompt) > reused for prompt in earlier)

    def _prefill(self, group: list[tuple[Sequence, list[int]]]) -> list[tuple[Sequence, list[int]]]:
        """One prefill call for (sequence, chunk) pairs of equal chunk lengths -> the first token of each sequence whose
        prompt it completed."""
        began = time.perf_counter()
        rows = [PrefillRow(s.slot, chunk, float(s.uniforms[0]), s.sampling, s.prefill_end) for s, chunk in group]
        out = self.engine.prefill(rows)
        self.last_prefill_seconds += time.perf_counter() - began
        emitted = []
        for row, (sequence, chunk) in enumerate(group):
            sequence.prefill_end = sequence.context_end = sequence.prefill_end + len(chunk)
            if sequence.prefilled:  # the last chunk's logits give the first token
                block, start = out.next_block[row].numpy(), int(out.next_start[row])
                emitted.append((sequence, sequence.commit(out.target_tokens[row].tolist(), 0, 0, block, start)))
        return emitted

    def _can_admit(self) -> bool:
        return bool(self.waiting and self.engine.pool.free_slots and len(self.active) < self.max_active)

    def _take_waiting(self) -> Sequence:
        """The next waiting sequence, in a slot of its own holding what prefix of its prompt it can."""
        sequence = self.waiting.popleft()
        sequence.began = time.perf_counter()
        sequence.slot, reused = self.engine.acquire(sequence.prompt, sequence.prefix_scope)  # holds prompt[:reused]
        sequence.stats.reused_prompt_tokens = sequence.prefill_end = reused
        self.active.append(sequence)
        return sequence

    def _generating(self) -> bool:
        return any(s.prefilled and not s.finished for s in self.active)

    def _batched_step(self) -> list[tuple[Sequence, list[int]]]:
        rows = [s for s in self.active if s.prefilled and not s.finished]
        if not rows:
            return []
        behind = [s.catch_up_tokens for s in rows]  # per row: drafter context left behind by `decode` steps
        # tokens each row may still make, on average: weighed only against a catch-up's cost (rows behind)
        left = sum(s.max_new_tokens - len(s.tokens) for s in rows) / len(rows) if any(behind) else np.inf
        wanted = self.policy.choose(len(rows), sum(behind), tuple(s.stats for s in rows), left)
        graph = "step" if wanted > 0 else self.policy.graph_when_idle
        if graph == "verify" and all(behind):
            graph = "decode"  # the drafter rows `verify` would write, a catch-up recomputes with those before them
        emitted: list[tuple[Sequence, list[int]]] = []
        if graph == "step" and any(behind):  # rows behind catch up instead; the others step
            lagging = [s for s, tokens in zip(rows, behind, strict=True) if tokens]
            rows = [s for s, tokens in zip(rows, behind, strict=True) if not tokens]
            emitted = self._catch_up(lagging)
            if not rows:
                return emitted
        drafts = min(wanted, *(s.drafts for s in rows))
        looked_up: list[int] | None = None  # lookup drafts per row, on a step that verifies none of the drafter's
        if graph == "step":
            # with lookup drafts on, each row's lookup drafts lead its block; else the drafter's blocks as they are
            blocks = [self._drafting_block(s, 1 + drafts) for s in rows] if self.policy.lookup_limit else None
            batch = self._batch(rows, 1 + drafts, wanted, blocks)
        else:
            proposals = [s.lookup.propose(self.policy.lookup_limit) for s in rows] if self.policy.lookup_limit else []
            extra = self.policy.lookup_drafts(graph, len(rows), [len(p) for p in proposals]) if proposals else 0
            looked_up = [min(len(p), extra) for p in proposals] if extra else None
            batch = self._lookup_batch(rows, proposals, extra) if extra else self._batch(rows, 1, 0)
            drafts = extra
        began = time.perf_counter()
        out = self.engine.run(graph, batch)
        seconds = time.perf_counter() - began
        accept_lens = out.accept_len.tolist()
        self.policy.observe(graph, len(rows), 1 + drafts, seconds, accept_lens, wanted if graph == "step" else 0, looked_up)
        self.last_width, self.last_batch = 1 + drafts, self.last_batch + len(rows)
        self.last_graph_seconds += seconds
        drafter_context = WRITES[graph] == WRITES["step"]  # `decode` leaves the drafter's context behind
        return emitted + [
            self._commit(
                s,
                out,
                row,
                accept_lens[row],
                drafts,
                drafter_context and not s.catch_up_tokens,  # lagging: a gap
                looked_up is not None,
            )  # fmt: skip
            for row, s in enumerate(rows)
        ]

    def _catch_up(self, rows: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """Recompute the rows of each sequence's tokens since its drafter context ends (`GraphEngine.catch_up`), in
        as few calls as equal lengths allow: a call takes the longest catch-up of its rows, and the others recompute
        rows of their own generated tokens before theirs (valid rows rewritten with the same values) -> each row's
        next token; the next block drafts the whole block."""
        emitted: list[tuple[Sequence, list[int]]] = []
        waiting = sorted(rows, key=lambda s: s.catch_up_tokens, reverse=True)
        while waiting:
            length = waiting[0].catch_up_tokens
            group = [s for s in waiting if s.start + 1 - length >= len(s.prompt)]  # recomputing only generated tokens
            waiting = [s for s in waiting if s.start + 1 - length < len(s.prompt)]
            began = time.perf_counter()
            out = self.engine.catch_up([self._catch_up_row(s, length) for s in group])
            seconds = time.perf_counter() - began
            self.policy.observe("catch_up", len(group), length, seconds, [0] * len(group))
            self.last_width, self.last_batch = 1, self.last_batch + len(group)
            self.last_graph_seconds += seconds
            emitted += [self._commit(s, out, row, 0, 0, drafter_context=True) for row, s in enumerate(group)]
        return emitted

    @staticmethod
    def _catch_up_row(sequence: Sequence, length: int) -> PrefillRow:
        """The last `length` tokens of the sequence up to its next block's first token (at `start`), from position
        start + 1 - length, and the uniform of the token that follows them."""
        first = sequence.start + 1 - length
        tokens = (sequence.prompt + sequence.tokens)[first : sequence.start + 1]
        return PrefillRow(sequence.slot, tokens, float(sequence.uniforms[len(sequence.tokens)]), sequence.sampling, first)

    def _batch(self, rows: list[Sequence], width: int, drafts: int, blocks: list[np.ndarray] | None = None) -> StepBatch:
        """The rows' next blocks, `width` tokens each (or `blocks` given so)."""
        uniforms = np.stack([s.uniforms[len(s.tokens) : len(s.tokens) + width] for s in rows])  # [B, V]
        return StepBatch(
            slots=torch.tensor([s.slot for s in rows]),
            block=torch.from_numpy(np.stack(blocks or [s.block[:width] for s in rows])),
            start=torch.tensor([s.start for s in rows]),
            uniforms=torch.from_numpy(uniforms),
            sampling=SamplingTensors.of([s.sampling for s in rows], self.engine.vocab_size),
            drafts=drafts,
        )

    @staticmethod
    def _drafting_block(sequence: Sequence, width: int) -> np.ndarray:
        """The sequence's next block, `width` tokens, with its lookup drafts in the first draft slots where it has any
        (counted in its stats' `lookup_in_blocks`). The drafter drafts each block slot from the context alone, not
        from the slots before it, so its later drafts stay as good behind lookup drafts. Over the demo pair's
        HumanEval answers (20 x 128 tokens up to the end of the turn, a greedy loop simulated over the target's own
        answers) a block of 1 + 4 gave 2.36 tokens a step so against the drafter's 1.89: the answers copy the
        prompt's names, which lookup drafts find exactly."""
        proposed = sequence.lookup.propose(width - 1)
        sequence.stats.lookup_in_blocks += len(proposed)
        return _lookup_first(sequence.block[:width], proposed)

    def _lookup_batch(self, rows: list[Sequence], proposals: list[list[int]], extra: int) -> StepBatch:
        """Each row's last token and `extra` lookup drafts (a row with fewer: its last token repeated after them)."""
        blocks = [
            _lookup_first(np.full(1 + extra, s.block[0], dtype=np.int64), proposed[:extra])
            for s, proposed in zip(rows, proposals, strict=True)
        ]
        return self._batch(rows, 1 + extra, 0, blocks)

    @staticmethod
    def _commit(
        sequence: Sequence,
        out: StepResult,
        row: int,
        accept_len: int,
        verified: int,
        drafter_context: bool,
        lookup: bool = False,
    ) -> tuple[Sequence, list[int]]:
        """Commit one row's tokens; `drafter_context`: the call wrote the drafter's context rows too, continuing those
        before them (not so for a row whose context `decode` steps left behind: its gap waits for a catch-up);
        `lookup`: the `verified` drafts were lookup drafts."""
        tokens = out.target_tokens[row, : accept_len + 1].tolist()
        next_block, next_start = out.next_block[row].numpy(), int(out.next_start[row])
        new = sequence.commit(tokens, accept_len, verified, next_block, next_start, lookup)
        if drafter_context:
            sequence.context_end = sequence.start
        return sequence, new

    def _retire(self, sequence: Sequence) -> None:
        self.active.remove(sequence)
        if sequence.prefilled:
            # Every state's rows of the tokens before `context_end` are in the slot: a later prompt that continues
            # this conversation starts after them. (`decode` steps leave the drafter's unwritten: plain decoding's none.)
            answer = sequence.tokens[: sequence.context_end - len(sequence.prompt)]
            self.engine.prefixes.extend(sequence.slot, len(sequence.prompt), answer)
        self.engine.pool.release(sequence.slot)
        sequence.slot = -1


def _lookup_first(block: np.ndarray, proposed: list[int]) -> np.ndarray:
    """A copy of `block` ([last token, guesses...]) with `proposed` lookup drafts in its first draft slots; any token is
    verified like a draft, so what fills the rest changes no output."""
    block = block.copy()
    block[1 : 1 + len(proposed)] = proposed
    return block


def _by_sequence(emitted: list[tuple[Sequence, list[int]]]) -> list[tuple[Sequence, list[int]]]:
    """Each sequence once, in first-emitted order, its tokens concatenated in order."""
    merged: dict[int, tuple[Sequence, list[int]]] = {}
    for sequence, tokens in emitted:
        merged.setdefault(id(sequence), (sequence, []))[1].extend(tokens)
    return list(merged.values())
