"""Lookup drafts: a sequence's next tokens guessed from what followed the latest earlier occurrence of its last
`NGRAM` tokens, in its prompt or its own output (prompt lookup decoding; TensorRT-LLM's and vLLM's n-gram drafting).
They cost nothing to make, and the target verifies them as it verifies the drafter's (`verify` and `decode` take a
block of any width), so outputs stay exact. Where the drafter does not know the traffic (the demo's code drafter on
chat turns), a text's own repetitions still draft; the verify policy weighs them on steps that draft nothing else.
On a step that drafts, a row's lookup drafts take the block's first slots and the drafter's the rest
(`Scheduler._drafting_block`): where answers copy their prompt (code repeating a signature's names), lookup drafts
are right more often than a small drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM = 2  # tokens matched: on the demo pair's MT-Bench answers, 2 drafted in 17% of steps and accepted 1.5 there


@dataclass
class NgramIndex:
    """A token sequence that only grows, with the position after the latest occurrence of each n-gram that has a
    following token (the sequence's last n-gram has none yet: a lookup finds an earlier one)."""

    n: int = NGRAM
    tokens: list[int] = field(default_factory=list)
    following: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index of the token after it

    def feed(self, new_tokens: list[int]) -> None:
        """Append tokens; index the n-grams that the new tokens follow."""
        first_end = max(len(self.tokens), self.n)
        self.tokens.extend(new_tokens)
        for end in range(first_end, len(self.tokens)):  # tokens[end - n:end] is followed by tokens[end]
            self.following[tuple(self.tokens[end - self.n : end])] = end

    def propose(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the last n tokens ([] if none)."""
        at = self.following.get(tuple(self.tokens[-self.n :])) if len(self.tokens) >= self.n else None
        return [] if at is None else self.tokens[at : at + count]
