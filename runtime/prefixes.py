"""Which prompt prefix each pool slot still holds, so that a prompt sharing it (a system prompt, a chat template's
fixed head, an earlier turn) is prefilled from where the shared part ends.

A slot's positional rows stay in the pool after its sequence ends (they are masked by position, never cleared),
so the rows of the prompt it prefilled remain valid until something writes over them. The engine records the
prompt tokens whose rows a slot holds when it prefills, and cuts the record back whenever any graph writes rows
of that slot at earlier positions (a new sequence's prefill, or the throw-away rows of a timing call).

Reuse is exact: a row depends only on the tokens at and before its position, and ONNX Runtime computes it with
the same bits whichever call computed it (tests/test_prefixes.py checks outputs against prefilling whole).

A target with recurrent states (Qwen3.5's Gated DeltaNet layers) keeps in them a slot's whole sequence, not its
prefixes: there a slot is reused only in full (all its held tokens begin the new prompt: a conversation's next turn)
and only while its recurrent states have taken in exactly those tokens, no more (a request that ended without its
answer recorded, or a timing call's throw-away step, moves them past the held rows).

A scope keeps users of one engine apart (vLLM's `cache_salt` does the same): a slot's rows are reused only by a
prompt of the scope whose request last held the slot; serving runs one scope, `dflash-bench` one per pass over its
prompts in each run.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


class SlotPrefixes:
    """slot -> the tokens at positions 0..n-1 whose rows the slot holds, and the scope they are reused in; with
    `whole` (a target with recurrent states), also how many tokens each slot's recurrent states have taken in."""

    def __init__(self, whole: bool = False) -> None:
        self.whole = whole
        self._tokens: dict[int, np.ndarray] = {}
        self._scopes: dict[int, Hashable] = {}
        self._ends: dict[int, int] = {}  # slot -> tokens its sequence's states have taken in (the next position)

    def longest(self, prompt: list[int], scope: Hashable = None) -> tuple[int, int]:
        """(slot, shared tokens) of the slot of `scope` holding the longest prefix of `prompt`, at most len(prompt) - 1
        tokens (the last prompt token is always computed: its logits give the first token); (-1, 0) if none. With
        `whole`, only a slot whose held tokens all begin the prompt and whose states end where they do."""
        wanted = np.asarray(prompt[:-1])
        best_slot, best = -1, 0
        for slot, held in self._tokens.items():
            if self._scopes.get(slot) != scope:
                continue
            shared = _common_prefix(held, wanted)
            if self.whole and not shared == len(held) == self._ends.get(slot):
                continue
            if shared > best:
                best_slot, best = slot, shared
        return best_slot, best

    def offers(self, held: Sequence[int], prompt: list[int]) -> int:
        """How many leading tokens of `prompt` a slot holding exactly `held` (its states ending after them) would let
        it reuse, as `longest` counts them."""
        shared = _common_prefix(np.asarray(held), np.asarray(prompt[:-1]))
        return 0 if self.whole and shared < len(held) else shared

    def enter(self, slot: int, scope: Hashable) -> None:
        """`slot` now serves a request of `scope`: what it holds is reused only there."""
        self._scopes[slot] = scope

    def held(self, slot: int) -> int:
        """How many leading tokens' rows `slot` holds."""
        return len(self._tokens.get(slot, ()))

    def end(self, slot: int) -> int:
        """How many tokens the states of `slot`'s sequence have taken in (its next position)."""
        return self._ends.get(slot, 0)

    def check_start(self, slot: int, start: int) -> None:
        """Raise ValueError unless a prefill of `slot` may start at `start`: its rows hold that many tokens and, with
        `whole`, its states end there."""
        if start > self.held(slot):
            raise ValueError(f"start={start}: slot {slot} holds the rows of {self.held(slot)} prompt tokens")
        if start and self.whole and self.end(slot) != start:
            raise ValueError(
                f"start={start}: slot {slot}'s recurrent states have taken in {self.end(slot)} tokens, not {start}: "
                "this target continues only a slot's whole sequence (prefill from start=0 instead)"
            )

    def prefilled(self, slot: int, start: int, tokens: list[int]) -> None:
        """A prefill wrote the rows of `tokens` at positions start.. of `slot`: it holds them, and its states end
        after them."""
        self.written(slot, start, start + len(tokens))
        self.extend(slot, start, tokens)

    def written(self, slot: int, first_position: int, end: int) -> None:
        """A graph call wrote rows of `slot` from `first_position` on, and its sequence now ends at `end`: held rows
        from there on hold something else now."""
        held = self._tokens.get(slot)
        if held is not None and first_position < len(held):
            self._tokens[slot] = held[:first_position]
        self._ends[slot] = end

    def extend(self, slot: int, start: int, tokens: list[int]) -> None:
        """Rows of `tokens` were written at positions start.. of `slot` (recorded only after `start` held tokens)."""
        held = self._tokens.get(slot, np.empty(0, dtype=np.int64))
        if len(held) >= start:
            self._tokens[slot] = np.concatenate([held[:start], np.asarray(tokens, dtype=np.int64)])

    def copy(self, source: int, target: int, rows: int) -> None:
        """`target` now holds `source`'s first `rows` tokens (`StatePool.copy_sequence`)."""
        self._tokens[target] = self._tokens[source][:rows].copy()
        self._scopes[target] = self._scopes.get(source)
        self._ends[target] = rows


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading elements `a` and `b` share."""
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).nonzero()[0]  # (not np.flatnonzero: half the cost)
    return int(differs[0]) if len(differs) else n
