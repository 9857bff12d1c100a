"""A small client for a served dflash model repository: gRPC streaming (default), unary gRPC and HTTP generate.

`stream_text` talks to the `ensemble` (text in, text out); `stream_tokens` to the token-level `dflash` model.
Both yield pieces as the server sends them (one per draft-verify step) and end with the request's statistics.
Inputs carry tensorrtllm_backend's names and its leading batch dimension of 1 ([1, 1] scalars, [1, N] lists).

Both survive a replica's death: each request is one gRPC stream, and a stream that ends without the request's
final response (a killed replica surfaces as CANCELLED, UNKNOWN or INTERNAL, never UNAVAILABLE, so gRPC's own
retry policies never fire) is retried whole on a new connection, skipping what was already yielded. Only greedy
and seeded requests are resumed that way (their output is reproducible); an unseeded sampled request that broke
after yielding output raises instead of splicing two samples.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient


class ServerError(RuntimeError):
    """The server answered the request with an error (its message says why), or the request could not be served."""


class StreamBroken(ServerError):
    """The stream ended without the request's final response: the connection or the replica failed."""


@dataclass(frozen=True)
class Retry:
    """How often a request whose stream broke is tried again, and how long to wait between tries."""

    tries: int = 4  # in all, the first included; 1 = never retry
    backoff_seconds: float = 0.25  # before the second try, doubled before each later one
    max_backoff_seconds: float = 4.0

    def wait(self, failed_tries: int) -> None:
        time.sleep(min(self.backoff_seconds * 2 ** (failed_tries - 1), self.max_backoff_seconds))


CANCEL_POLL_SECONDS = 0.05  # how often a stream waiting for a response checks its `cancel` event
# Answers of a replica that cannot run the request, which another replica (or this one restarted) can serve:
# tritonserver shutting down after SIGTERM, or a model whose Python-backend stub died (dflash-serve restarts it).
CANNOT_SERVE = ("Server not ready", "has no available versions", "Request for unknown model", "is not healthy")


@dataclass(frozen=True)
class Request:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    stop_words: tuple[str, ...] = ()
    stream: bool = True

    def fields(self) -> dict[str, Any]:
        """Triton inputs (tensorrtllm_backend names) other than the prompt, omitting unset optionals. top_p is always
        sent: under TensorRT-LLM's conventions a request with neither top_k nor top_p is greedy at any temperature."""
        values: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
        }
        if self.seed is not None:
            values["random_seed"] = self.seed
        if self.end_id is not None:
            values["end_id"] = self.end_id
        if self.stop_words:
            values["stop_words"] = list(self.stop_words)
        return values

    @property
    def reproducible(self) -> bool:
        """Greedy (as the server reads these fields: temperature 0, top_k 1, or neither top_k nor top_p) or seeded:
        served again, it gives the same output, so a broken stream can be resumed by asking again."""
        greedy = self.temperature == 0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0)
        return greedy or self.seed is not None


STAT_OUTPUTS = (
    "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate", "total_steps", "total_output_tokens",
    "reused_prompt_tokens",
)  # fmt: skip
NUMPY_TYPES = {
    "max_tokens": np.int32,
    "stream": np.bool_,
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "random_seed": np.uint64,
    "end_id": np.int32,
    "exclude_input_in_output": np.bool_,
}


def _text_fields(request: Request) -> dict[str, Any]:
    """The ensemble's inputs: the completion alone, without the prompt in front (tensorrtllm_backend's default)."""
    return {**request.fields(), "exclude_input_in_output": True}


@dataclass
class Timing:
    """Client-side latencies of one request."""

    started: float = field(default_factory=time.perf_counter)
    arrivals: list[float] = field(default_factory=list)

    def mark(self) -> None:
        self.arrivals.append(time.perf_counter())

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.started if self.arrivals else float("nan")

    @property
    def inter_token(self) -> float:
        """Mean seconds between successive responses (each may carry several tokens)."""
        gaps = np.diff(self.arrivals)
        return float(gaps.mean()) if len(gaps) else float("nan")


def grpc_inputs(prompt_name: str, prompt: np.ndarray, fields: dict[str, Any]) -> list[grpcclient.InferInput]:
    """[1, ...] tensors: the prompt (ids or text) and each field."""
    tensors = [(prompt_name, prompt.reshape(1, -1))]
    for name, value in fields.items():
        array = np.array([value], dtype=object) if name == "stop_words" else np.array([[value]], dtype=NUMPY_TYPES[name])
        tensors.append((name, array))
    inputs = []
    for name, array in tensors:
        datatype = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_stream(
    url: str,
    model: str,
    inputs: list[grpcclient.InferInput],
    outputs: tuple[str, ...],
    timeout: float = 600.0,
    cancel: threading.Event | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """One decoupled request over a gRPC stream: yields each non-empty response's named outputs. A consumer that
    stops early (closes the generator: Ctrl-C, a disconnected HTTP client upstream) cancels the request, which frees
    its slot on the server within a step; closing the stream without cancelling would wait for the whole answer.
    `cancel`, set from another thread, does the same for a consumer that cannot close the generator (one waiting in
    it for the next response): the generator ends within CANCEL_POLL_SECONDS, even while the request still queues."""
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    ended = False  # the final response (or an error) arrived: nothing is left to cancel
    try:
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        except grpcclient.InferenceServerException as failure:  # the stream failed before the request went out
            raise StreamBroken(f"{url}: {_stream_failure(answers, failure)}") from None
        while True:
            try:
                arrived = _next_answer(answers, timeout, cancel)
            except queue.Empty:
                raise StreamBroken(f"no response from {url} in {timeout:.0f} s") from None
            if arrived is None:
                return  # cancelled: the request is cancelled on the way out
            result, error = arrived
            if error is not None:  # the model's answer carries no gRPC status; a failed stream does
                ended = True
                broken = error.status() is not None or any(answer in str(error) for answer in CANNOT_SERVE)
                raise StreamBroken(str(error)) if broken else ServerError(str(error))
            arrays = {name: result.as_numpy(name) for name in outputs if result.as_numpy(name) is not None}
            if arrays:
                yield arrays
            if result.get_response().parameters["triton_final_response"].bool_param:
                ended = True
                return
    finally:
        client.stop_stream(cancel_requests=not ended)
        client.close()


def _next_answer(answers: queue.Queue[tuple[Any, Any]], timeout: float, cancel: threading.Event | None) -> tuple[Any, Any] | None:
    """The stream's next (result, error); None once `cancel` is set. Raises queue.Empty after `timeout` seconds."""
    if cancel is None:
        return answers.get(timeout=timeout)
    deadline = time.monotonic() + timeout
    while not cancel.is_set():
        try:
            return answers.get(timeout=min(CANCEL_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
        except queue.Empty:
            if time.monotonic() >= deadline:
                raise
    return None


def _stream_failure(answers: queue.Queue[tuple[Any, Any]], failure: grpcclient.InferenceServerException) -> str:
    """Why a stream failed before its request went out. Where the connection failed first, tritonclient hands the
    cause to the stream's callback and raises only "The stream is no longer in valid state, the error detail is
    reported through provided callback ..."; the cause is then taken from there."""
    try:
        _, error = answers.get(timeout=1.0)
    except queue.Empty:
        return str(failure.message())
    return str(error) if error is not None else str(failure.message())


UNITS = {"text": "characters", "tokens": "tokens"}  # what one item of a piece's key is


Piece = dict[str, Any]  # one response: "tokens" or "text", and the request's statistics so far


def resumed(attempt: Callable[[], Iterator[Piece]], key: str, request: Request, retry: Retry) -> Iterator[Piece]:
    """Yield `attempt()`'s pieces; when its stream breaks, call it again and skip the items of `piece[key]` (tokens
    or characters) already yielded, up to `retry.tries` tries in all."""
    sent = 0  # items of `key` yielded so far, over all tries
    failures: list[str] = []
    while True:
        seen = 0  # items of `key` this try has produced
        try:
            for piece in attempt():
                items = piece[key]
                skip = min(max(sent - seen, 0), len(items))
                seen += len(items)
                if skip and skip == len(items):
                    continue  # an earlier try yielded all of it
                sent += len(items) - skip
                yield {**piece, key: items[skip:]}
            return
        except StreamBroken as error:
            failures.append(f"try {len(failures) + 1}: {error}")
            if sent and not request.reproducible:
                raise StreamBroken(
                    f"the stream broke after {sent} {UNITS.get(key, key)} had been received ({failures[-1]}); an unseeded "
                    "sampled request cannot be resumed without mixing two samples: set a seed to make it retryable"
                ) from None
            if len(failures) >= retry.tries:
                raise StreamBroken(f"gave up after {len(failures)} tries: " + "; ".join(failures)) from None
            retry.wait(len(failures))


def stream_tokens(
    url: str,
    input_ids: list[int],
    request: Request,
    timing: Timing | None = None,
    retry: Retry = Retry(),
    cancel: threading.Event | None = None,
) -> Iterator[dict[str, Any]]:
    """Token ids in, token ids out through the `dflash` model: yields {"tokens": [...], stats...} per response
    (`cancel`: see grpc_stream)."""
    inputs = grpc_inputs("input_ids", np.asarray(input_ids, dtype=np.int64), request.fields())

    def attempt() -> Iterator[dict[str, Any]]:
        for arrays in grpc_stream(url, "dflash", inputs, ("output_ids", *STAT_OUTPUTS), cancel=cancel):
            yield {
                "tokens": arrays["output_ids"].reshape(-1).tolist(),
                **{k: v.reshape(-1)[0].item() for k, v in arrays.items() if k != "output_ids"},
            }

    for piece in resumed(attempt, "tokens", request, retry):
        if timing is not None:
            timing.mark()
        yield piece


def stream_text(
    url: str,
    text: str,
    request: Request,
    timing: Timing | None = None,
    retry: Retry = Retry(),
    cancel: threading.Event | None = None,
) -> Iterator[dict[str, Any]]:
    """Text in, text out through the `ensemble`: yields {"text": "...", stats...} per response (`cancel`: see
    grpc_stream)."""
    inputs = grpc_inputs("text_input", np.array([text.encode("utf-8")], dtype=object), _text_fields(request))

    def attempt() -> Iterator[dict[str, Any]]:
        for arrays in grpc_stream(url, "ensemble", inputs, ("text_output", *STAT_OUTPUTS), cancel=cancel):
            yield _text_answer(arrays)

    for piece in resumed(attempt, "text", request, retry):
        if timing is not None:
            timing.mark()
        yield piece


def infer_text(url: str, text: str, request: Request, timeout: float = 600.0) -> dict[str, Any]:
    """Unary gRPC infer on the ensemble (a server started with `dflash-serve --unary`): one answer, stream off."""
    fields = {**_text_fields(request), "stream": False}
    inputs = grpc_inputs("text_input", np.array([text.encode("utf-8")], dtype=object), fields)
    client = grpcclient.InferenceServerClient(url)
    try:
        outputs = [grpcclient.InferRequestedOutput(name) for name in ("text_output", *STAT_OUTPUTS)]
        result = client.infer("ensemble", inputs, outputs=outputs, client_timeout=timeout)
    except grpcclient.InferenceServerException as error:
        raise ServerError(error.message()) from None
    finally:
        client.close()
    return _text_answer({name: result.as_numpy(name) for name in ("text_output", *STAT_OUTPUTS)})


def _text_answer(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    piece = b"".join(arrays["text_output"].reshape(-1)).decode("utf-8")
    return {"text": piece, **{k: v.reshape(-1)[0].item() for k, v in arrays.items() if k != "text_output"}}


def http_generate_stream(base_url: str, text: str, request: Request, timing: Timing | None = None) -> Iterator[dict[str, Any]]:
    """Triton's HTTP generate_stream endpoint (server-sent events) on the ensemble. Closing the generator stops the
    request at its next step; with `request.stream` False the answer comes whole at the end and, like
    `http_generate`'s, runs to its end after its reader leaves."""
    with _post(f"{base_url}/v2/models/ensemble/generate_stream", {"text_input": text, **_text_fields(request)}) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                raise ServerError(event["error"])
            if timing is not None:
                timing.mark()
            yield {
                "text": event.get("text_output", ""),
                **{k: v for k, v in event.items() if k in STAT_OUTPUTS},
            }


def http_generate(base_url: str, text: str, request: Request) -> dict[str, Any]:
    """Triton's HTTP generate endpoint (one JSON answer; the request must not stream). A client that leaves does not
    stop it: Triton's HTTP frontend notices a closed connection only when it writes a response (server issue 7077),
    and this request has one, at its end; `http_generate_stream` stops within a step of its reader leaving."""
    body = {"text_input": text, **_text_fields(request), "stream": False}
    with _post(f"{base_url}/v2/models/ensemble/generate", body) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def _post(url: str, body: dict[str, Any]) -> Any:  # noqa: ANN401 (urllib's response)
    """POST JSON to a Triton endpoint; an error status becomes a ServerError carrying Triton's message: generate
    answers a refused request with {"error": ...}, generate_stream with that object as a server-sent event."""
    post = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"), headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(post, timeout=600)
    except urllib.error.HTTPError as error:
        answer = error.read().decode("utf-8", errors="replace").strip().removeprefix("data:")
        try:
            message = str(json.loads(answer)["error"])
        except (ValueError, KeyError, TypeError):  # not Triton's answer (a proxy's page): the status
            message = f"HTTP {error.code} {error.reason} from {url}"
        raise ServerError(message) from None
