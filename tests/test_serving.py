"""Serving for real: tritonserver on a dflash-build repository, real gRPC/HTTP traffic from tritonclient."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.client.cli import main as client_main
from dflash_trt.client.triton_client import (
    Request,
    ServerError,
    grpc_inputs,
    grpc_stream,
    http_generate,
    http_generate_stream,
    infer_text,
    stream_text,
    stream_tokens,
)
from dflash_trt.runtime.loop import StopCriteria, generate, generate_plain
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import SamplingParams
from transformers import AutoModelForCausalLM, AutoTokenizer

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
    """The streamed tokens equal in-process decoding; a step's accepted drafts arrive together with its own token
    (one response per step), so accepted drafts mean a response of several tokens. How many drafts a step
    verifies is the server's choice by measured cost: that it drafts at all is not asserted here."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    for prompt in PROMPTS:
        responses = list(stream_tokens(server.grpc, tokenizer(prompt)["input_ids"], Request(MAX_TOKENS)))
        tokens = [t for r in responses for t in r["tokens"]]
        assert tokens == in_process[prompt]
        final = responses[-1]
        assert final["total_output_tokens"] == len(tokens)
        # the prefill's token, then accepted + 1 per step (the last step may be cut at max_tokens)
        assert final["total_steps"] < len(tokens) <= 1 + final["total_steps"] + final["total_accepted_draft_tokens"]
        if final["total_accepted_draft_tokens"] > 0:
            assert max(len(r["tokens"]) for r in responses) >= 2


def test_ensemble_text_over_grpc_and_http_equals_in_process(
    server: Server, tiny_repo: Path, in_process: dict[str, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    for prompt in PROMPTS:
        expected = tokenizer.decode(in_process[prompt], skip_special_tokens=True)
        assert "".join(r["text"] for r in stream_text(server.grpc, prompt, Request(MAX_TOKENS))) == expected
        assert "".join(r["text"] for r in http_generate_stream(server.http, prompt, Request(MAX_TOKENS))) == expected
    # dflash-client, each protocol, streamed and printed whole (over HTTP the latter streams too: see the client)
    expected = tokenizer.decode(in_process[PROMPTS[0]], skip_special_tokens=True)
    http, grpc = server.http, server.grpc
    modes = [(grpc, []), (grpc, ["--no-stream"]), (http, ["--http"]), (http, ["--http", "--no-stream"])]
    for url, flags in modes:
        assert client_main([PROMPTS[0], "--url", url, "--max-tokens", str(MAX_TOKENS), *flags]) == 0
        assert capsys.readouterr().out == expected + "\n", flags
    # a refused request: Triton answers with an error status; the client raises the model's message, not the status
    with pytest.raises(ServerError, match="exceeds the maximum sequence length 256"):
        list(http_generate_stream(server.http, PROMPTS[0], Request(5000)))


def _metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(server.metrics, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


def _final_stats(server: Server, prompt: list[int], request: Request) -> tuple[list[int], dict[str, float]]:
    tokens, last = [], {}
    for response in stream_tokens(server.grpc, prompt, request):
        tokens.extend(response["tokens"])
        last = response
    return tokens, last


def _concurrently(count: int, work) -> dict[int, object]:  # noqa: ANN001
    results: dict[int, object] = {}

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except Exception as error:  # surfaced by the caller's assertion, with its message
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return results


MIXED = 32


def _mixed_request(index: int) -> tuple[list[int], Request]:
    """Client `index` of MIXED: prompt lengths 2..31, max_tokens 4..60, every third seeded sampling (T=0.9, top-k 20)."""
    generator = np.random.default_rng(index)
    prompt = generator.integers(1, 90, int(generator.integers(2, 32))).tolist()
    sampled = index % 3 == 2
    request = Request(
        int(generator.integers(4, 61)),
        temperature=0.9 if sampled else 0.0,
        top_k=20 if sampled else 0,
        seed=500 + index if sampled else None,
    )
    return prompt, request


def test_32_concurrent_mixed_clients_each_get_what_they_get_alone(server: Server, tiny_repo: Path) -> None:
    """Greedy rows equal serial greedy decoding, seeded rows equal the same request served alone; requests join and
    leave a running batch (8 slots, 32 clients); the counters add up to what the clients were told."""
    engine, _ = load_engine(tiny_repo)
    expected = {}
    for index in range(MIXED):
        prompt, request = _mixed_request(index)
        sampling = SamplingParams(request.temperature, request.top_k, request.top_p, request.seed)
        expected[index] = generate_plain(engine, prompt, request.max_tokens, sampling).tokens
    names = ("dflash_draft_tokens_total", "dflash_accepted_draft_tokens_total", "dflash_generated_tokens_total")
    before = {n: _metric(server, n) for n in names}
    results = _concurrently(MIXED, lambda i: _final_stats(server, *_mixed_request(i)))
    for index in range(MIXED):
        assert not isinstance(results[index], Exception), results[index]
        assert results[index][0] == expected[index], f"client {index}: {_mixed_request(index)[1]}"
    assert grpcclient.InferenceServerClient(server.grpc).is_server_ready()
    finals = [results[i][1] for i in range(MIXED)]
    assert _metric(server, "dflash_draft_tokens_total") - before[names[0]] == sum(f["total_draft_tokens"] for f in finals)
    assert _metric(server, "dflash_accepted_draft_tokens_total") - before[names[1]] == sum(
        f["total_accepted_draft_tokens"] for f in finals
    )
    assert _metric(server, "dflash_generated_tokens_total") - before[names[2]] == sum(len(expected[i]) for i in range(MIXED))
    assert _metric(server, "dflash_free_slots") == 8


def test_a_shared_prompt_head_is_prefilled_once_and_counted(server: Server, tiny_repo: Path) -> None:
    """Two requests with the same 20-token head, one after the other: the second prefills only its own tail (the
    reused-prompt-token counter grows by the head, and its responses say so) and both get what in-process decoding
    without reuse gives."""
    engine, _ = load_engine(tiny_repo, reuse_prefixes=False)
    head = np.random.default_rng(77).integers(1, 90, 20).tolist()
    prompts = [head + [11, 12, 13], head + [40]]
    expected = [generate(engine, prompt, MAX_TOKENS).tokens for prompt in prompts]
    served, reported = [], []
    for prompt in prompts:
        before = _metric(server, "dflash_reused_prompt_tokens_total")
        responses = list(stream_tokens(server.grpc, prompt, Request(MAX_TOKENS)))
        served.append([t for r in responses for t in r["tokens"]])
        reported.append(responses[-1]["reused_prompt_tokens"])
    assert _metric(server, "dflash_reused_prompt_tokens_total") - before == len(head) == reported[1]
    assert served == expected


def test_a_thousand_short_ensemble_streams_end_cleanly(server: Server, tiny_repo: Path, in_process: dict[str, list[int]]) -> None:
    """Short streamed text requests back to back from 8 threads, each answered as it is served alone. The ensemble's
    cancellation watcher once asked Triton whether a request was cancelled just after the request's final response
    had freed it: tritonserver died with SIGSEGV after 240 to 1,100 such requests."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    expected = {n: tokenizer.decode(in_process[PROMPTS[0]][:n], skip_special_tokens=True) for n in (1, 2, 3)}

    def answers(thread: int) -> list[bool]:
        lengths = [1 + (thread + k) % 3 for k in range(125)]
        return ["".join(r["text"] for r in stream_text(server.grpc, PROMPTS[0], Request(n))) == expected[n] for n in lengths]

    results = _concurrently(8, answers)
    for thread in range(8):
        assert not isinstance(results[thread], Exception), results[thread]
        assert all(results[thread]), f"thread {thread}: {results[thread].count(False)} answers differ"
    assert grpcclient.InferenceServerClient(server.grpc).is_server_ready()


def test_a_bad_request_in_a_busy_batch_gets_its_error_and_the_others_finish(server: Server, tiny_repo: Path) -> None:
    engine, _ = load_engine(tiny_repo)

    def work(index: int) -> object:
        if index == 3:
            return list(stream_tokens(server.grpc, [5, 6, 7], Request(8, temperature=1.0, top_p=1.5)))
        prompt, request = _mixed_request(index)
        return _final_stats(server, prompt, Request(request.max_tokens))[0]

    results = _concurrently(6, work)
    assert isinstance(results[3], ServerError) and "top_p=1.5 is outside" in str(results[3])
    for index in (0, 1, 2, 4, 5):
        prompt, request = _mixed_request(index)
        assert results[index] == generate_plain(engine, prompt, request.max_tokens).tokens


def test_cancel_mid_stream_frees_the_slot_for_the_next_request(server: Server, tiny_repo: Path) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = grpc_inputs("input_ids", np.array([5, 6, 7, 8], dtype=np.int64), Request(200).fields())
    client.async_stream_infer("dflash", inputs, enable_empty_final_response=True)
    answers.get(timeout=60)  # generating
    assert _metric(server, "dflash_free_slots") == 7
    began = time.perf_counter()
    client.stop_stream(cancel_requests=True)
    client.close()
    while _metric(server, "dflash_free_slots") != 8:
        assert time.perf_counter() - began < 10, "the cancelled request kept its slot"
        time.sleep(0.05)
    engine, _ = load_engine(tiny_repo)
    assert _final_stats(server, [9, 8, 7], Request(6))[0] == generate_plain(engine, [9, 8, 7], 6).tokens


def test_served_end_id_and_stop_words_end_generation(server: Server, tiny_repo: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    engine, _ = load_engine(tiny_repo)
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    full = generate_plain(engine, prompt, MAX_TOKENS).tokens
    end_id = full[10]
    cut = full.index(end_id) + 1
    assert _final_stats(server, prompt, Request(MAX_TOKENS, end_id=end_id))[0] == full[:cut]
    stop_word = tokenizer.decode(full[12:14])
    stop_at = StopCriteria(stop_strings=(stop_word,), decode=tokenizer.decode).first_stop(full, 0)
    assert stop_at is not None and stop_at < len(full)
    assert _final_stats(server, prompt, Request(MAX_TOKENS, stop_words=(stop_word,)))[0] == full[:stop_at]
    text = "".join(r["text"] for r in stream_text(server.grpc, PROMPTS[0], Request(MAX_TOKENS, stop_words=(stop_word,))))
    assert text == tokenizer.decode(full[:stop_at], skip_special_tokens=True)


def _raw_inputs(**tensors: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in tensors.items():
        datatype = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


def _i32(*values: int) -> np.ndarray:
    return np.array([values], np.int32)


def _f32(value: float) -> np.ndarray:
    return np.array([[value]], np.float32)


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
    "bad top_p": (dict(text_input=_text("w5"), max_tokens=_i32(8), top_p=_f32(1.3)), "top_p=1.3 is outside"),
    "infinite temperature": (dict(text_input=_text("w5"), max_tokens=_i32(8), temperature=_f32(np.inf)), "temperature=inf"),
    "prompt not UTF-8": (
        dict(text_input=np.array([[b"w5 \xff w6"]], dtype=object), max_tokens=_i32(8)),
        "text_input is not UTF-8 text \\(byte 0xff at position 3\\)",
    ),
    "stop word not UTF-8": (
        dict(text_input=_text("w5"), max_tokens=_i32(8), stop_words=np.array([[b"w7", b"\xc3("]], dtype=object)),
        "stop_words\\[1\\] is not UTF-8 text \\(byte 0xc3 at position 0\\)",
    ),
    "no batch dimension": (dict(text_input=np.array([b"w5"], dtype=object), max_tokens=_i32(8)), "text_input"),
    "two prompts in one request": (
        dict(text_input=np.array([[b"w5"], [b"w6"]], dtype=object), max_tokens=np.array([[8], [8]], np.int32)),
        "text_input has batch size 2: send one prompt per request",
    ),
    "beam search": (dict(text_input=_text("w5"), max_tokens=_i32(8), beam_width=_i32(2)), "beam_width=2 is not supported"),
    "several sequences": (
        dict(text_input=_text("w5"), max_tokens=_i32(8), num_return_sequences=_i32(3)),
        "num_return_sequences=3 is not supported",
    ),
    "penalty": (
        dict(text_input=_text("w5"), max_tokens=_i32(8), repetition_penalty=_f32(1.2)),
        "repetition_penalty=1.2 is not supported",
    ),
    "bad words": (
        dict(text_input=_text("w5"), max_tokens=_i32(8), bad_words=np.array([[b"w7"]], dtype=object)),
        "bad_words is not supported",
    ),
    "log probs": (
        dict(text_input=_text("w5"), max_tokens=_i32(8), return_log_probs=np.array([[True]])),
        "return_log_probs=True is not supported",
    ),
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


# --- tensorrtllm_backend's clients, unchanged -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def unary_server(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tiny_repo, tmp_path_factory.mktemp("triton-unary"), unary=True) as ports:
        yield Server(f"localhost:{ports.grpc}", f"http://localhost:{ports.http}", f"http://localhost:{ports.metrics}/metrics")


@pytest.fixture(scope="module")
def transformers_greedy(tiny_targets: dict[str, Path], tiny_repo: Path) -> dict[str, str]:
    """transformers' greedy completion of each prompt, as text (the tiny tokenizer has no chat template)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_repo / TOKENIZER_DIR)
    model = AutoModelForCausalLM.from_pretrained(tiny_targets["qwen3"], dtype=torch.float32)
    completions = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        output = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        completions[prompt] = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
    return completions


def _end_to_end_client_inputs(prompt: str, output_len: int, streaming: bool) -> list[grpcclient.InferInput]:
    """What tensorrtllm_backend's inflight_batcher_llm/client/end_to_end_grpc_client.py sends by default: its five
    inputs plus exclude_input_in_output, every one [1, 1] with its dtypes, temperature 1.0 and no top_k/top_p."""
    return _raw_inputs(
        text_input=np.array([[prompt]]).astype(object),
        max_tokens=np.array([[output_len]], dtype=np.int32),
        stream=np.array([[streaming]], dtype=bool),
        beam_width=np.array([[1]], dtype=np.int32),
        temperature=np.array([[1.0]], dtype=np.float32),
        exclude_input_in_output=np.array([[False]], dtype=bool),
    )


def _end_to_end_client_text(url: str, prompt: str, streaming: bool) -> str:
    """That client's stream: start_stream, one async_stream_infer asking for text_output, stop_stream (which waits
    for the end), then each response's text_output[0] decoded, appended when streaming."""
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error if error else result))
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    inputs = _end_to_end_client_inputs(prompt, MAX_TOKENS, streaming)
    client.async_stream_infer("ensemble", inputs, outputs=outputs, request_id="")
    client.stop_stream()
    client.close()
    text = ""
    while not answers.empty():
        answer = answers.get()
        assert not isinstance(answer, Exception), answer
        piece = answer.as_numpy("text_output")[0].decode("utf-8")
        text = text + piece if streaming else piece
    return text


def test_tensorrtllm_backend_end_to_end_client_gets_greedy_text(
    server: Server, unary_server: Server, transformers_greedy: dict[str, str]
) -> None:
    """Streaming, non-streaming (prompt echoed in front, tensorrtllm_backend's default) and unary infer on the unary
    configuration: each equals transformers' greedy completion."""
    for prompt in PROMPTS[:3]:
        expected = transformers_greedy[prompt]
        assert _end_to_end_client_text(server.grpc, prompt, streaming=True) == expected
        assert _end_to_end_client_text(server.grpc, prompt, streaming=False) == prompt + expected
        client = grpcclient.InferenceServerClient(unary_server.grpc)
        result = client.infer("ensemble", _end_to_end_client_inputs(prompt, MAX_TOKENS, streaming=False))
        assert result.as_numpy("text_output")[0].decode("utf-8") == prompt + expected
        assert infer_text(unary_server.grpc, prompt, Request(MAX_TOKENS))["text"] == expected
        assert http_generate(unary_server.http, prompt, Request(MAX_TOKENS))["text_output"] == expected


def test_readme_curl_request_and_unary_streaming_refusal(
    server: Server, unary_server: Server, transformers_greedy: dict[str, str]
) -> None:
    """tensorrtllm_backend README's generate request (empty bad_words/stop_words strings) on both configurations;
    a streaming request to the unary configuration is refused with the fix."""
    body = {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": ""}
    for base in (server.http, unary_server.http):
        post = urllib.request.Request(f"{base}/v2/models/ensemble/generate", data=json.dumps(body).encode())
        with urllib.request.urlopen(post, timeout=120) as response:
            assert json.loads(response.read())["text_output"] == PROMPTS[0] + transformers_greedy[PROMPTS[0]]
    with pytest.raises(ServerError, match="stream=true needs the decoupled ensemble.*dflash-serve --unary"):
        list(stream_text(unary_server.grpc, PROMPTS[0], Request(MAX_TOKENS)))


LONG = 200  # tokens a cancelled request asked for (max_seq_len 256)


def _wait_free_slots(server: Server, count: int, seconds: float) -> float:
    began = time.perf_counter()
    while _metric(server, "dflash_free_slots") != count:
        assert time.perf_counter() - began < seconds, f"free slots stayed at {_metric(server, 'dflash_free_slots')}"
        time.sleep(0.005)
    return time.perf_counter() - began


def _long_ensemble_stream(url: str) -> tuple[grpcclient.InferenceServerClient, queue.Queue]:
    """An ensemble stream asking for LONG tokens with no end token, once its first response has arrived."""
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    fields = {**Request(LONG, end_id=-1).fields(), "exclude_input_in_output": True}
    client.async_stream_infer("ensemble", grpc_inputs("text_input", np.array([b"w3 w4"], dtype=object), fields))
    answers.get(timeout=60)
    return client, answers


DISCONNECTING_CLIENT = """
import os, sys
from dflash_trt.client.triton_client import Request, stream_text
for _ in stream_text(sys.argv[1], "w3 w4", Request({long}, end_id=-1)):
    os._exit(0)  # gone mid-stream: no cancel, the connection just drops
"""


@pytest.mark.parametrize("how", ["cancel", "disconnect", "stop reading", "stop reading over HTTP"])
def test_ensemble_stream_cancel_or_disconnect_frees_the_slot_within_a_step(server: Server, tiny_repo: Path, how: str) -> None:
    """Triton does not pass a cancellation on to a model called by another; the ensemble front sends dflash a stop
    request, so the sequence leaves the batch (slot freed, generation stopped) long before its LONG tokens. "stop
    reading": the toolkit's own client closed mid-stream (Ctrl-C in dflash-client, dflash-openai's HTTP client gone)
    cancels its request; it used to close the stream by waiting for every token. Over HTTP, Triton sees the closed
    connection when it writes the next response (so only streamed requests can be stopped by leaving)."""
    generated = _metric(server, "dflash_generated_tokens_total")
    if how == "cancel":
        client, _ = _long_ensemble_stream(server.grpc)
        assert _metric(server, "dflash_free_slots") == 7
        client.stop_stream(cancel_requests=True)
        client.close()
    elif how.startswith("stop reading"):
        stream = (
            http_generate_stream(server.http, "w3 w4", Request(LONG, end_id=-1))
            if how.endswith("HTTP")
            else stream_text(server.grpc, "w3 w4", Request(LONG, end_id=-1))
        )
        next(stream)
        stream.close()
    else:
        script = DISCONNECTING_CLIENT.format(long=LONG)
        subprocess.run([sys.executable, "-c", script, server.grpc], check=True, timeout=120)
    _wait_free_slots(server, 8, seconds=5)
    assert _metric(server, "dflash_generated_tokens_total") - generated < LONG / 2, "generation went on after the client left"
    engine, _ = load_engine(tiny_repo)
    began = time.perf_counter()
    assert _final_stats(server, [9, 8, 7], Request(1))[0] == generate_plain(engine, [9, 8, 7], 1).tokens
    assert time.perf_counter() - began < 5
