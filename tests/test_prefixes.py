"""Prompt prefix reuse: a prompt that starts like one prefilled before (a system prompt, an earlier turn of the same
conversation) is prefilled from where the shared part ends, with the same output as prefilling it whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash_trt.runtime.engine import GraphEngine, PrefillRow
from dflash_trt.runtime.loop import Sequence, generate, generate_plain
from dflash_trt.runtime.prefixes import SlotPrefixes
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.scheduler import Scheduler, time_call

SYSTEM = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]  # the head every prompt below shares
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_repo: Path) -> GraphEngine:
    return load_engine(tiny_repo, max_batch=4)[0]


def test_slot_prefixes_find_the_longest_shared_prefix_and_forget_overwritten_rows() -> None:
    prefixes = SlotPrefixes()
    prefixes.extend(0, 0, [1, 2, 3, 4])
    prefixes.extend(1, 0, [1, 2, 9])
    assert prefixes.longest([1, 2, 3, 4]) == (0, 3), "the last prompt token is always computed"
    assert prefixes.longest([1, 2, 9, 9]) == (1, 3)
    assert prefixes.longest([5, 1]) == (-1, 0)
    prefixes.written(0, 2, 3)  # e.g. a timing call's throw-away rows from position 2 on
    assert prefixes.held(0) == 2 and prefixes.longest([1, 2, 3, 4])[1] == 2
    prefixes.extend(0, 2, [7, 7])  # a prefill from position 2, after the 2 rows the slot holds
    assert prefixes.longest([1, 2, 7, 7, 0]) == (0, 4)
    prefixes.copy(1, 3, 2)
    assert prefixes.held(3) == 2
    prefixes.enter(1, "tenant b")  # the slot now serves another scope: its rows are reused there only
    assert prefixes.longest([1, 2, 9, 9]) == (0, 2) and prefixes.longest([1, 2, 9, 9], "tenant b") == (1, 3)
    assert prefixes.longest([1, 2, 7, 7, 0], "tenant c") == (-1, 0)


def test_with_recurrent_states_only_a_whole_sequence_whose_states_end_there_is_reused() -> None:
    """`whole` (a target with recurrent states, which hold a slot's whole sequence): a slot counts only if all its
    held tokens begin the prompt and its states have taken in exactly those."""
    prefixes = SlotPrefixes(whole=True)
    prefixes.written(0, 0, 4)  # a prefill of 4 tokens
    prefixes.extend(0, 0, [1, 2, 3, 4])
    assert prefixes.longest([1, 2, 3, 4, 5]) == (0, 4), "a conversation's next turn: the whole sequence"
    assert prefixes.longest([1, 2, 3, 9, 5]) == (-1, 0), "a shared head alone: the states hold more than it"
    assert prefixes.longest([1, 2, 3, 4]) == (-1, 0), "the last prompt token is computed: the states would be past it"
    prefixes.written(0, 4, 6)  # a step: the states took in 2 more tokens, whose answer was not recorded
    assert prefixes.longest([1, 2, 3, 4, 5]) == (-1, 0)
    prefixes.extend(0, 4, [5, 6])  # the answer recorded when its request ended
    assert prefixes.longest([1, 2, 3, 4, 5, 6, 7]) == (0, 6)
    prefixes.copy(0, 1, 6)
    assert prefixes.end(1) == 6 and prefixes.held(1) == 6


def _serve_together(engine: GraphEngine, sequences: list[Sequence]) -> None:
    scheduler = Scheduler(engine)
    for sequence in sequences:
        scheduler.submit(sequence)
    while scheduler.busy:
        scheduler.step()


def test_a_shared_prompt_head_is_prefilled_once_and_outputs_stay_exact(engine: GraphEngine) -> None:
    """Three prompts with the same head served together (greedy and seeded sampling): the second and third copy the
    first one's rows of the head from its slot while it runs and compute only their own tails; every output equals
    the same request prefilled whole."""
    tails = ([11, 12], [40, 41, 42, 43, 44], [60])
    samplings = (SamplingParams(), SamplingParams(), SamplingParams(temperature=0.9, seed=5))
    engine.reuse_prefixes = False
    whole = [generate(engine, SYSTEM + tail, NEW_TOKENS, s).tokens for tail, s in zip(tails, samplings, strict=True)]
    engine.reuse_prefixes = True
    engine.prefixes = SlotPrefixes(whole=engine.recurrent)  # nothing held from the runs above
    sequences = [Sequence(SYSTEM + tail, NEW_TOKENS, s) for tail, s in zip(tails, samplings, strict=True)]
    _serve_together(engine, sequences)
    assert [s.stats.reused_prompt_tokens for s in sequences] == [0, len(SYSTEM), len(SYSTEM)]
    assert [s.tokens for s in sequences] == whole


def test_prompts_admitted_together_share_a_prefill_call_and_outputs_stay_exact(
    engine: GraphEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four prompts submitted together: the first two (as many tokens to prefill, one greedy, one seeded) run in one
    prefill call; the third, sharing the first one's head, waits for its rows and reuses them as if each prompt had
    been prefilled alone, then shares a call with the fourth (2 tokens each, from positions 5 and 0); every output
    equals the same request served alone."""
    prompts = [[40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55], [40, 41, 42, 43, 44, 46, 47], [60, 61]]
    samplings = (SamplingParams(), SamplingParams(temperature=0.9, seed=5), SamplingParams(), SamplingParams())
    engine.reuse_prefixes = False
    alone = [generate(engine, p, NEW_TOKENS, s).tokens for p, s in zip(prompts, samplings, strict=True)]
    engine.reuse_prefixes = True
    engine.prefixes = SlotPrefixes(whole=engine.recurrent)  # nothing held from the runs above
    prefill_shapes = []
    run = engine.runner.run

    def counted(graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if graph == "prefill":
            prefill_shapes.append(tuple(inputs["input_ids"].shape))
        return run(graph, inputs)

    monkeypatch.setattr(engine.runner, "run", counted)
    sequences = [Sequence(p, NEW_TOKENS, s) for p, s in zip(prompts, samplings, strict=True)]
    _serve_together(engine, sequences)
    assert prefill_shapes == [(2, 6), (2, 2)]
    assert [s.stats.reused_prompt_tokens for s in sequences] == [0, 0, 5, 0]
    assert [s.tokens for s in sequences] == alone


def test_a_slot_taken_by_another_scope_offers_its_old_rows_to_no_one(engine: GraphEngine) -> None:
    """Every slot holds a prompt of scope x; two prompts of scope y arrive together. The first takes a slot, whose
    old rows it overwrites once prefilled; until then, the second (as many tokens to prefill if it could reuse the
    head it shares with those rows) must not reuse them: they were another scope's."""
    engine.reuse_prefixes = True
    engine.prefixes = SlotPrefixes(whole=engine.recurrent)
    held = SYSTEM[:12]
    _serve_together(engine, [Sequence(list(held), 2, prefix_scope="x") for _ in range(engine.pool.slots)])
    assert all(engine.prefixes.held(slot) >= len(held) for slot in range(engine.pool.slots))
    first = Sequence([70 + i for i in range(8)], 2, prefix_scope="y")
    second = Sequence(held[:6] + [80 + i for i in range(8)], 2, prefix_scope="y")  # 8 tokens left after 6 reused
    _serve_together(engine, [first, second])
    assert [first.stats.reused_prompt_tokens, second.stats.reused_prompt_tokens] == [0, 0]


def test_a_conversation_turn_starts_after_the_previous_answer(engine: GraphEngine) -> None:
    """The next turn's prompt is the previous prompt + answer + new text: the conversation so far is reused (all of
    it, or all but the answer's last token if no step computed that token's rows), and the output equals prefilling
    the whole conversation."""
    engine.reuse_prefixes = True
    prompt = SYSTEM + [21, 22, 23]
    answer = generate(engine, prompt, NEW_TOKENS).tokens
    follow_up = prompt + answer + [44, 45, 46]
    second = generate(engine, follow_up, NEW_TOKENS)
    assert len(prompt) + len(answer) - 1 <= second.stats.reused_prompt_tokens <= len(prompt) + len(answer)
    engine.reuse_prefixes = False
    assert generate(engine, follow_up, NEW_TOKENS).tokens == second.tokens
    engine.reuse_prefixes = True


def test_a_plain_decoded_answer_is_not_held(engine: GraphEngine) -> None:
    """Plain decoding's `decode` graph writes the target's rows only, so after it a slot holds just the prompt: a
    next turn must not read the drafter's unwritten rows of that answer."""
    prompt = SYSTEM + [31, 32]
    answer = generate_plain(engine, prompt, NEW_TOKENS).tokens
    assert engine.prefixes.longest(prompt + answer + [5])[1] == len(prompt)
    answer = generate(engine, prompt, NEW_TOKENS).tokens  # DFlash keeps every state: the answer is held too
    assert engine.prefixes.longest(prompt + answer + [5])[1] >= len(prompt) + len(answer) - 1


def test_rows_written_over_a_held_prefix_are_not_reused(engine: GraphEngine) -> None:
    """A timing call writes throw-away rows from position 0 of the free slots: no slot holds the prompt afterwards,
    so the next request prefills it whole (and still equals its first output)."""
    engine.reuse_prefixes = True
    prompt = SYSTEM + [70, 71]
    first = generate(engine, prompt, NEW_TOKENS).tokens
    assert engine.prefixes.longest(prompt)[1] == len(prompt) - 1
    time_call(engine, "decode", engine.pool.free_slots, 1, 1, 0, repeats=0)
    assert engine.prefixes.longest(prompt) == (-1, 0)
    again = generate(engine, prompt, NEW_TOKENS)
    assert again.stats.reused_prompt_tokens == 0 and again.tokens == first


def test_a_prefill_past_the_rows_a_slot_holds_is_refused(engine: GraphEngine) -> None:
    slot = engine.pool.acquire()
    try:
        engine.prefixes.written(slot, 0, 0)
        with pytest.raises(ValueError, match=rf"start=5: slot {slot} holds the rows of 0 prompt tokens"):
            engine.prefill([PrefillRow(slot, [1, 2], 0.0, SamplingParams(), start=5)])
    finally:
        engine.pool.release(slot)


def test_a_prompt_prefilled_in_chunks_while_others_generate_keeps_outputs_exact(engine: GraphEngine) -> None:
    """With `prefill_chunk`, a prompt admitted while another sequence generates is prefilled a chunk per step (each
    chunk continuing the slot's rows where the last ended) and the running stream gets tokens at every one of those
    steps; the outputs (greedy and seeded sampling) equal each request served alone, and a request cancelled
    halfway through its prefill frees its slot."""
    with pytest.raises(ValueError, match="prefill_chunk=-1"):
        Scheduler(engine, prefill_chunk=-1)
    engine.reuse_prefixes = False
    running = Sequence(SYSTEM + [1, 2], 3 * NEW_TOKENS)
    late = [
        Sequence(SYSTEM + [50 + i for i in range(17)], NEW_TOKENS),
        Sequence([90, 91, 92], NEW_TOKENS),
        Sequence(SYSTEM + [80, 81], NEW_TOKENS, SamplingParams(temperature=0.9, seed=5)),
    ]
    alone = [generate(engine, s.prompt, s.max_new_tokens, s.sampling).tokens for s in (running, *late)]
    scheduler = Scheduler(engine, prefill_chunk=8)
    scheduler.submit(running)
    scheduler.step()  # nothing else generates: the whole prompt at once
    assert running.prefilled and running.tokens
    for sequence in late:
        scheduler.submit(sequence)
    ends = []
    while not all(s.prefilled for s in late):
        before = len(running.tokens)
        scheduler.step()
        assert len(running.tokens) > before, "the running stream gets a token at every step of a chunked prefill"
        ends.append([s.prefill_end for s in late])
    # 8 prompt tokens per step; after a chunk, a prompt starts only if all of it fits in what is left (3 of 5 do, 20
    # do not: it starts in the next step)
    assert ends == [[8, 0, 0], [16, 0, 0], [24, 0, 0], [32, 0, 0], [35, 3, 0], [35, 3, 8], [35, 3, 16], [35, 3, 20]]
    while scheduler.busy:
        scheduler.step()
    assert [s.tokens for s in (running, *late)] == alone
    cancelled = Sequence(SYSTEM * 2, NEW_TOKENS)
    scheduler.submit(Sequence(SYSTEM, 4 * NEW_TOKENS))
    scheduler.step()
    scheduler.submit(cancelled)
    scheduler.step()
    assert 0 < cancelled.prefill_end < len(cancelled.prompt)
    scheduler.cancel(cancelled)
    assert cancelled.slot == -1 and engine.pool.free_slots == engine.pool.slots - 1
    engine.reuse_prefixes = True
