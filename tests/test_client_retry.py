"""The client's resumption of a broken stream (`resumed`), on scripted streams: what a killed replica looks like to
the client is shown end to end in tests/test_fleet.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from dflash_trt.client.triton_client import Request, Retry, ServerError, StreamBroken, resumed

TOKENS = list(range(100, 120))
FAST = Retry(tries=3, backoff_seconds=0.0)


def _attempts(*plans: tuple[list[int], bool]) -> Any:  # noqa: ANN401
    """One call per plan: yields the plan's piece sizes of TOKENS (from the start, as a server that is asked again
    would), then breaks if the plan says so."""
    calls = iter(plans)

    def attempt() -> Iterator[dict[str, Any]]:
        sizes, breaks = next(calls)
        start = 0
        for size in sizes:
            yield {"tokens": TOKENS[start : start + size], "total_steps": start}
            start += size
        if breaks:
            raise StreamBroken("StatusCode.CANCELLED: Stream removed")

    return attempt


def test_a_broken_stream_resumes_where_it_broke_whatever_the_new_piece_sizes() -> None:
    attempt = _attempts(([1, 3, 4], True), ([1, 2, 2], True), ([1, 5, 6, 8], False))
    pieces = list(resumed(attempt, "tokens", Request(), FAST))
    assert [t for p in pieces for t in p["tokens"]] == TOKENS
    assert [len(p["tokens"]) for p in pieces] == [1, 3, 4, 4, 8]


def test_an_unseeded_sampled_request_is_not_spliced() -> None:
    attempt = _attempts(([1, 3], True), ([20], False))
    with pytest.raises(StreamBroken, match="after 4 tokens had been received.*set a seed"):
        list(resumed(attempt, "tokens", Request(temperature=0.8), FAST))
    seeded = list(resumed(_attempts(([1, 3], True), ([20], False)), "tokens", Request(temperature=0.8, seed=7), FAST))
    assert [t for p in seeded for t in p["tokens"]] == TOKENS
    nothing_yet = list(resumed(_attempts(([], True), ([20], False)), "tokens", Request(temperature=0.8), FAST))
    assert [t for p in nothing_yet for t in p["tokens"]] == TOKENS


def test_retries_are_bounded_and_the_error_says_why_each_failed() -> None:
    attempt = _attempts(([1], True), ([1], True), ([1], True), ([20], False))
    with pytest.raises(StreamBroken, match=r"gave up after 3 tries: try 1: .*Stream removed; try 2: .*; try 3: "):
        list(resumed(attempt, "tokens", Request(), FAST))


def test_an_error_answered_by_the_model_is_not_retried() -> None:
    calls = []

    def attempt() -> Iterator[dict[str, Any]]:
        calls.append(1)
        raise ServerError("max_tokens=0 must be positive")
        yield {}

    with pytest.raises(ServerError, match="max_tokens=0"):
        list(resumed(attempt, "tokens", Request(), FAST))
    assert len(calls) == 1


def test_a_replica_that_is_not_there_is_tried_again_and_the_error_says_so() -> None:
    """A refused connection (a replica gone) breaks the stream before any answer; each try is named in the error."""
    from dflash_trt.client.triton_client import stream_tokens
    from dflash_trt.runtime.serve import free_port

    url = f"localhost:{free_port()}"  # nothing listens there
    with pytest.raises(StreamBroken, match=r"gave up after 6 tries: try 1: .*; try 2: ") as failure:
        list(stream_tokens(url, [1, 2, 3], Request(4), retry=Retry(tries=6, backoff_seconds=0.0)))
    # Every try names the cause, also where tritonclient raised only that the stream is no longer valid (its cause
    # was handed to the callback): in 1 try of 2 to 4 on a 2-core CPU before that was read from there.
    tries = str(failure.value).split("; try ")
    assert len(tries) == 6 and all("Connection refused" in t for t in tries), str(failure.value)
