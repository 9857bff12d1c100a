"""Serving for real: tritonserver on a dflash-build repository, real gRPC/HTTP traffic from tritonclient."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.client.triton_client import Request, ServerError, grpc_stream, http_generate_stream, stream_text, stream_tokens
from dflash_trt.runtime.loop import generate
from dflash_trt.runtime.repository import load_engine
from transformers import AutoTokenizer

from tests.conftest import running_server

pytestmark = pytest.mark.slow
PROMPTS = ["w3 w14 w15 w9 w26", "w5 w35 w89", "w7 w7 w7 w1 w2 w3 w4", "w60 w61", "w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21"]
MAX_TOKENS = 40


@dataclass(frozen=True)
class Server:
    grpc: str
    http: str
    metrics: str


@pytest.fixture(scope="module")
def server(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tiny_repo, tmp_path_factory.mktemp("triton")) as ports:
        yield Server(f"localhost:{ports.grpc}", f"http://localhost:{ports.http}", f"http://localhost:{ports.metrics}/metrics")


@pytest.fixture(scope="module")
def in_process(tiny_repo: Path) -> dict[str, list[int]]:
    engine, _ = load_engine(tiny_repo)
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    return {p: generate(engine, tokenizer(p)["input_ids"], MAX_TOKENS).tokens for p in PROMPTS}


def _tokens(server: Server, prompt: str, tokenizer) -> list[list[int]]:
    return [r["tokens"] for r in stream_tokens(server.grpc, tokenizer(prompt)["input_ids"], Request(MAX_TOKENS))]


def test_grpc_token_stream_equals_in_process(server: Server, tiny_repo: Path, in_process: dict[str, list[int]]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    widest = 0
    for prompt in PROMPTS:
        responses = _tokens(server, prompt, tokenizer)
        assert [t for r in responses for t in r] == in_process[prompt]
        widest = max(widest, *(len(r) for r in responses))
    assert widest >= 2, "a step that accepts drafts sends several tokens in one response"


def test_ensemble_text_over_grpc_and_http_equals_in_process(
    server: Server, tiny_repo: Path, in_process: dict[str, list[int]]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    for prompt in PROMPTS:
        expected = tokenizer.decode(in_process[prompt], skip_special_tokens=True)
        assert "".join(r["text"] for r in stream_text(server.grpc, prompt, Request(MAX_TOKENS))) == expected
        assert "".join(r["text"] for r in http_generate_stream(server.http, prompt, Request(MAX_TOKENS))) == expected


def _metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(server.metrics, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_eight_concurrent_streams_are_isolated_and_counted(
    server: Server, tiny_repo: Path, in_process: dict[str, list[int]]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    engine, _ = load_engine(tiny_repo)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    expected_draft = sum(generate(engine, tokenizer(p)["input_ids"], MAX_TOKENS).stats.draft_tokens for p in prompts)
    expected_accepted = sum(generate(engine, tokenizer(p)["input_ids"], MAX_TOKENS).stats.accepted_draft_tokens for p in prompts)
    before = {
        n: _metric(server, n)
        for n in ("dflash_draft_tokens_total", "dflash_accepted_draft_tokens_total", "dflash_generated_tokens_total")
    }
    results: dict[int, list[int]] = {}

    def client(index: int) -> None:
        results[index] = [t for r in _tokens(server, prompts[index], tokenizer) for t in r]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(results[i] == in_process[prompts[i]] for i in range(8))
    assert grpcclient.InferenceServerClient(server.grpc).is_server_ready()
    assert _metric(server, "dflash_draft_tokens_total") - before["dflash_draft_tokens_total"] == expected_draft
    assert (
        _metric(server, "dflash_accepted_draft_tokens_total") - before["dflash_accepted_draft_tokens_total"] == expected_accepted
    )
    assert _metric(server, "dflash_generated_tokens_total") - before["dflash_generated_tokens_total"] == 8 * MAX_TOKENS


def _raw_inputs(**tensors: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in tensors.items():
        datatype = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


def _i32(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


def _f32(value: float) -> np.ndarray:
    return np.array([value], np.float32)


BAD_REQUESTS = {
    "empty text": (dict(text_input=_text(""), max_tokens=_i32(8)), "text_input is empty"),
    "max_tokens 0": (dict(text_input=_text("w5"), max_tokens=_i32(0)), "max_tokens=0 must be positive"),
    "max_tokens over the limit": (dict(text_input=_text("w5"), max_tokens=_i32(5000)), "exceeds the maximum sequence length 256"),
    "prompt too long": (
        dict(text_input=_text(" ".join(["w5"] * 300)), max_tokens=_i32(8)),
        "exceeds the maximum sequence length",
    ),
    "wrong dtype": (dict(text_input=_text("w5"), max_tokens=_f32(8.0)), "max_tokens"),
    "wrong shape": (dict(text_input=_text("w5"), max_tokens=_i32(8, 9)), "max_tokens"),
    "unknown parameter": (dict(text_input=_text("w5"), max_tokens=_i32(8), temprature=_f32(1.0)), "temprature"),
    "bad top_p": (dict(text_input=_text("w5"), max_tokens=_i32(8), top_p=_f32(0.0)), "top_p=0.0 is outside"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_an_error_and_the_server_keeps_serving(
    server: Server, in_process: dict[str, list[int]], tiny_repo: Path, case: str
) -> None:
    tensors, message = BAD_REQUESTS[case]
    with pytest.raises(ServerError, match=message):
        list(grpc_stream(server.grpc, "ensemble", _raw_inputs(**tensors), ("text_output",)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    assert [t for r in _tokens(server, PROMPTS[0], tokenizer) for t in r] == in_process[PROMPTS[0]]
