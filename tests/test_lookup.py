"""Lookup drafts: the n-gram index over a growing token sequence."""

from __future__ import annotations

from dflash_trt.runtime.lookup import NgramIndex


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    index = NgramIndex(n=2)
    index.feed([7, 1, 2, 3, 4, 1, 2, 9])
    assert index.propose(3) == []  # the last 2-gram (2, 9) occurred nowhere before
    index.feed([5, 1, 2])
    assert index.propose(3) == [9, 5, 1]  # after the latest earlier (1, 2): position 6, not position 1
    assert index.propose(1) == [9]
    index.feed([9])
    assert index.propose(8) == [5, 1, 2, 9]  # up to the sequence's end


def test_feeding_in_pieces_indexes_as_feeding_at_once() -> None:
    tokens = [4, 4, 4, 8, 4, 4, 8, 1, 4, 4]
    whole, pieces = NgramIndex(n=2), NgramIndex(n=2)
    whole.feed(tokens)
    for start in range(0, len(tokens), 3):
        pieces.feed(tokens[start : start + 3])
    assert pieces.following == whole.following and pieces.propose(4) == whole.propose(4) == [8, 1, 4, 4]
    short = NgramIndex(n=3)
    short.feed([1, 2])
    assert short.propose(2) == []  # fewer tokens than the n-gram
