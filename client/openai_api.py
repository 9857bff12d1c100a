"""dflash-openai: an OpenAI-compatible front end for a served dflash repository.

`/v1/models`, `/v1/completions` (raw text) and `/v1/chat/completions` (the repository's chat template), streamed
by server-sent events or answered whole, with `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n` (and a list
of prompts) and `usage`. The choices of a request are generated at once, each its own request to Triton.
It tokenizes here (the repository holds the tokenizer), talks to the token-level `dflash` model over gRPC, so
it fronts one replica or a fleet's balancer (and retries a request whose replica died, as the Python client
does), and detokenizes incrementally. A `--backend trtllm` repository has no token-level model: there the prompt
goes as text through the `ensemble` (chat template rendered here, with the target's tokenizer from --tokenizer),
TensorRT-LLM detokenizes, and the completion's tokens are counted here for `usage` and `finish_reason`. Errors
come back in OpenAI's shape: {"error": {"message", "type", "param", "code"}}. The Gateway API Inference Extension
and llm-d route on this API plus the `dflash` model's gauges.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Generator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from dflash_trt.client.triton_client import Request, ServerError, StreamBroken, stream_text, stream_tokens
from dflash_trt.runtime.options import port_number, require_at_least
from pydantic import BaseModel, ConfigDict, Field

try:  # FastAPI reads the endpoints' annotations from this module's names
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request as StarletteRequest
except ImportError:  # without the `serve` extra: main() says what to install
    StarletteRequest = Any  # type: ignore[misc,assignment]

DISCONNECT_POLL_SECONDS = 0.05  # how often a completion answered whole checks that its client is still there
MAX_CHOICES = 128  # choices of one request (n x prompts), OpenAI's limit of n
UNSUPPORTED = {"best_of": 1, "echo": False, "logprobs": None, "suffix": None, "tools": None, "logit_bias": None}


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Sampling(BaseModel):
    """The fields both endpoints share, with OpenAI's defaults (temperature 1: sampled unless set to 0)."""

    model_config = ConfigDict(extra="allow")  # other OpenAI fields are checked against UNSUPPORTED, else ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def requests(self, default_max_tokens: int) -> list[Request]:
        """The request of each of a prompt's n choices: choice j sampled with seed + j when a seed is given."""
        for name, neutral in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name, neutral)
            if value != neutral:
                raise InvalidRequest(f"{name}={value!r} is not supported (only {name}={neutral!r})", name)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise InvalidRequest(f"stop={self.stop!r}: give up to 4 non-empty strings", "stop")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        request = Request(max_tokens, self.temperature, 0, self.top_p, self.seed, None, tuple(stops), True)
        return [request if self.seed is None else replace(request, seed=self.seed + j) for j in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # text or token ids, one prompt or a list of them

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]  # one prompt: text, or token ids
        return list(self.prompt)  # type: ignore[arg-type]


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p.get("text") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content):
            raise InvalidRequest("only text content parts are supported", "messages")
        return "".join(str(p) for p in parts)


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)


class StopTrim:
    """Cuts the text at the first stop string (OpenAI leaves it out) and holds back, while streaming, the tail that
    could still be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, piece: str, last: bool) -> str:
        if self.stopped:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s, max(self.sent - self.hold, 0)) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.text = True, self.text[:cut]
            end = cut
        else:
            end = len(self.text) if last else max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out


class Answered(NamedTuple):
    """One response of a completion from Triton."""

    text: str  # new since the last response
    finish: str | None  # finish_reason: None until the last response
    completion_tokens: int  # so far
    cached_tokens: int | None = None  # prompt tokens whose rows the engine reused (None: the engine does not say)


class Frontend:
    """The tokenizer, the chat template and where Triton is."""

    def __init__(
        self,
        repo: Path,
        triton_url: str,
        model_name: str | None = None,
        default_max_tokens: int = 16,
        tokenizer: str | None = None,
    ) -> None:
        from dflash_trt.builder.repository import TOKENIZER_DIR, read_repository_manifest
        from transformers import AutoTokenizer

        manifest = read_repository_manifest(repo)
        self.text_level = manifest["backend"] == "trtllm"  # TensorRT-LLM: text through the ensemble
        source = tokenizer or (repo / TOKENIZER_DIR if (repo / TOKENIZER_DIR).is_dir() else None)
        if source is None:
            raise ValueError(
                "this --backend trtllm repository holds no tokenizer: pass --tokenizer with the target's (a directory, "
                f"or its hub id {manifest['target']['source']!r} where the hub cache has it)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.eos = set(manifest.get("eos_token_ids", []))
        self.model = model_name or Path(manifest["target"]["source"]).name
        self.url, self.default_max_tokens, self.created = triton_url, default_max_tokens, int(time.time())

    def prompts(self, body: CompletionBody | ChatBody) -> list[tuple[str, list[int]]]:
        """Each prompt as text (what a text-level model is sent) and as token ids (what the token-level model is
        sent, and what `usage` counts): the conversation of a chat, the prompt or prompts of a completion."""
        if isinstance(body, ChatBody):
            if not self.tokenizer.chat_template:
                raise InvalidRequest(f"the model {self.model} has no chat template: use /v1/completions", "messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
            return [(text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))]
        prompts = body.prompts()
        if not prompts or len(prompts) * body.n > MAX_CHOICES:
            raise InvalidRequest(
                f"{len(prompts)} prompts x n={body.n}: give 1 to {MAX_CHOICES} choices (prompts x n) per request", "prompt"
            )
        return [self._prompt(prompt) for prompt in prompts]

    def _prompt(self, prompt: str | list[int]) -> tuple[str, list[int]]:
        """A prompt given as token ids goes to the token-level model as it is, once they are known to the tokenizer
        (a text-level model gets their decoded text; the server checks them against the engine's vocabulary too)."""
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        outside = [t for t in prompt if not 0 <= t < len(self.tokenizer)]
        if outside:
            raise InvalidRequest(
                f"prompt token ids {outside[:5]} are not in the tokenizer's vocabulary [0, {len(self.tokenizer)})", "prompt"
            )
        return str(self.tokenizer.decode(prompt)), prompt

    def generate(
        self, text: str, ids: list[int], request: Request, cancel: threading.Event | None = None
    ) -> Generator[Answered, None, None]:
        """Each response from Triton (`cancel`: see triton_client.grpc_stream)."""
        if self.text_level:
            yield from self._generate_text(text, request, cancel)
            return
        from dflash_trt.runtime.detokenize import TextStream

        text_stream, trim, generated, ended_by_eos = TextStream(self.tokenizer), StopTrim(request.stop_words), 0, False
        cached = None
        for piece in stream_tokens(self.url, ids, request, cancel=cancel):
            generated += len(piece["tokens"])
            ended_by_eos = ended_by_eos or any(t in self.eos for t in piece["tokens"])
            cached = piece["reused_prompt_tokens"]
            yield Answered(trim.push(text_stream.push(piece["tokens"]), last=False), None, generated, cached)
        tail = trim.push("", last=True)
        finish = "stop" if trim.stopped or ended_by_eos or generated < request.max_tokens else "length"
        yield Answered(tail, finish, generated, cached)

    def _generate_text(self, prompt: str, request: Request, cancel: threading.Event | None) -> Generator[Answered, None, None]:
        """The text-level path: the engine detokenizes; the completion's tokens are counted once it ended (a turn
        shorter than max_tokens ended by itself: "stop")."""
        trim, completion = StopTrim(request.stop_words), ""
        for piece in stream_text(self.url, prompt, request, cancel=cancel):
            completion += piece["text"]
            yield Answered(trim.push(piece["text"], last=False), None, 0)
        tail, generated = trim.push("", last=True), len(self.tokenizer(completion, add_special_tokens=False)["input_ids"])
        yield Answered(tail, "stop" if trim.stopped or generated < request.max_tokens else "length", generated)


class Choices:
    """The choices of one request (n per prompt, choice i of prompt i // n, OpenAI's order), generated at once: each
    choice's stream is read in a thread of its own, their responses merged in arrival order as (choice, response).
    Iterating to the end, an error, or `close` cancels every choice still running."""

    def __init__(self, frontend: Frontend, choices: list[tuple[str, list[int], Request]]) -> None:
        self.cancel = threading.Event()
        self.arrived: queue.Queue[tuple[int, Answered | Exception | None]] = queue.Queue()  # None: that choice ended
        self.running = len(choices)
        for index, (text, ids, request) in enumerate(choices):
            responses = frontend.generate(text, ids, request, self.cancel)
            threading.Thread(target=self._read, args=(index, responses), daemon=True).start()

    def _read(self, index: int, responses: Iterator[Answered]) -> None:
        try:
            for answer in responses:
                self.arrived.put((index, answer))
        except Exception as failure:  # raised to the reader, which answers the HTTP client with it
            self.arrived.put((index, failure))
        finally:
            self.arrived.put((index, None))

    def __iter__(self) -> Iterator[tuple[int, Answered]]:
        try:
            while self.running:
                index, item = self.arrived.get()
                if item is None:
                    self.running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            self.close()

    def close(self) -> None:
        self.cancel.set()


def usage(prompts: list[list[int]], finals: Sequence[Answered]) -> dict[str, Any]:
    """OpenAI's `usage` of a request: each prompt counted once, every choice's completion; the prompt tokens cached
    are those every choice of a prompt reused (its choices are finals[i * n : (i + 1) * n])."""
    prompt_tokens, completion_tokens = sum(len(ids) for ids in prompts), sum(a.completion_tokens for a in finals)
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    reused = [a.cached_tokens for a in finals if a.cached_tokens is not None]
    if len(reused) == len(finals):  # as OpenAI reports prompt caching
        n = len(finals) // len(prompts)
        counts["prompt_tokens_details"] = {"cached_tokens": sum(min(reused[i : i + n]) for i in range(0, len(reused), n))}
    return counts


def create_app(frontend: Frontend) -> Any:  # noqa: ANN401 (a FastAPI app)
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="dflash-openai")

    class ClosingStreamingResponse(StreamingResponse):
        """Cancels its choices as soon as sending ends, however it ends. When the client has gone mid-stream,
        Starlette stops sending but leaves a sync iterator to the garbage collector: a request went on generating
        for ~4 s more (the demo pair, 2 cores) before a collection closed the stream that cancels it."""

        def __init__(self, events: Generator[str, None, None], choices: Choices) -> None:
            super().__init__(events, media_type="text/event-stream")
            self.choices = choices

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # noqa: ANN401 (ASGI)
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.choices.close()  # every Triton stream still open closes and cancels its request

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)

    @app.exception_handler(RequestValidationError)
    def invalid_body(_request: Any, exc: RequestValidationError) -> JSONResponse:  # noqa: ANN401
        message, param = body_error(exc.errors()[0])
        return error(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequest)
    def invalid_request(_request: Any, exc: InvalidRequest) -> JSONResponse:  # noqa: ANN401
        return error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ServerError)
    def server_error(_request: Any, exc: ServerError) -> JSONResponse:  # noqa: ANN401
        if isinstance(exc, StreamBroken):  # no replica could finish it
            return error(503, str(exc), "server_error")
        return error(400, str(exc), "invalid_request_error")  # the model refused the request, saying why

    @app.exception_handler(Exception)
    def internal_error(_request: Any, exc: Exception) -> JSONResponse:  # noqa: ANN401
        # Starlette logs the traceback here too (uvicorn's error log) once this answer is sent
        return error(500, f"dflash-openai failed on this request ({type(exc).__name__}: {exc}); see its log", "server_error")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": frontend.model, "object": "model", "created": frontend.created, "owned_by": "dflash-trt"}],
        }

    async def answer(body: CompletionBody | ChatBody, chat: bool, connection: Any) -> Any:  # noqa: ANN401
        if body.model and body.model != frontend.model:  # none or "": the one model served
            return error(
                404,
                f"the model {body.model!r} does not exist; this server serves {frontend.model!r}",
                "invalid_request_error",
                "model",
            )
        prompts = await run_in_threadpool(frontend.prompts, body)
        requests = body.requests(frontend.default_max_tokens)
        choices = Choices(frontend, [(text, ids, request) for text, ids in prompts for request in requests])
        count, prompt_ids = len(prompts) * len(requests), [ids for _, ids in prompts]
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": frontend.model,
        }

        def choice(index: int, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            key, content = ("delta", {"content": text}) if delta else ("message", {"role": "assistant", "content": text})
            return {"index": index, key: content, "logprobs": None, "finish_reason": finish}

        if not body.stream:  # streamed from Triton all the same, so that a client that leaves is noticed between steps
            answers: list[list[Answered]] = [[] for _ in range(count)]
            for index, answer in await read_while_connected(choices, connection):
                answers[index].append(answer)
            kind = "chat.completion" if chat else "text_completion"
            texts = ["".join(a.text for a in per_choice) for per_choice in answers]
            finals = [per_choice[-1] for per_choice in answers]
            listed = [choice(i, texts[i], finals[i].finish, False) for i in range(count)]
            return {**head, "object": kind, "choices": listed, "usage": usage(prompt_ids, finals)}

        kind = "chat.completion.chunk" if chat else "text_completion"
        merged = iter(choices)
        first = await run_in_threadpool(next, merged)  # a refused request gets its HTTP error here, before the stream

        def events() -> Generator[str, None, None]:
            finals: dict[int, Answered] = {}
            if chat:
                for index in range(count):
                    opening = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield _sse({**head, "object": kind, "choices": [opening]})
            try:
                for index, answer in itertools.chain([first], merged):
                    finals[index] = answer
                    if answer.text or answer.finish:
                        yield _sse({**head, "object": kind, "choices": [choice(index, answer.text, answer.finish, True)]})
            except ServerError as failure:
                yield _sse({"error": {"message": str(failure), "type": "server_error", "param": None, "code": None}})
                return
            if body.include_usage:
                yield _sse({**head, "object": kind, "choices": [], "usage": usage(prompt_ids, [finals[i] for i in range(count)])})
            yield "data: [DONE]\n\n"

        return ClosingStreamingResponse(events(), choices)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, connection: StarletteRequest) -> Any:  # noqa: ANN401
        return await answer(body, False, connection)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, connection: StarletteRequest) -> Any:  # noqa: ANN401
        return await answer(body, True, connection)

    return app


async def read_while_connected(choices: Choices, connection: Any) -> list[tuple[int, Answered]]:  # noqa: ANN401
    """Every response of a request answered whole, read in a worker thread; a client that leaves meanwhile (its
    timeout, say) cancels its choices on the server (Starlette cancels no handler when its client leaves). Checked
    every DISCONNECT_POLL_SECONDS."""
    reading = asyncio.ensure_future(run_in_threadpool(list, choices))
    while not reading.done():
        if await connection.is_disconnected():
            choices.close()
            break
        await asyncio.wait({reading}, timeout=DISCONNECT_POLL_SECONDS)
    return await reading


FIELD_FORMS = {  # what a field takes, for the fields whose type is a choice of several
    "prompt": "a string or token ids (a list of integers), or a list of one of those",
    "stop": "a string or a list of up to 4 strings",
    "content": "a string or a list of text parts",
}


def body_error(first: dict[str, Any]) -> tuple[str, str | None]:
    """A request body's first validation error as (message, param). Pydantic names a union's member in the error's
    location (`prompt.str`, `stop.list[str]`), which says nothing to a client: a field of several forms is named
    with the forms it takes instead. A body that is not JSON at all names where parsing stopped."""
    if first.get("type") == "json_invalid":
        reason, where = first.get("ctx", {}).get("error", "JSON decode error"), first.get("loc", ())[-1]
        return f"the request body is not valid JSON ({reason} at character {where})", None
    path: list[str] = []
    for part in first.get("loc", ())[1:]:  # ("body", field, ...)
        if isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part):  # a union's member
            field = next((p for p in reversed(path) if not p.isdigit()), "")
            return f"{'.'.join(path)}: give {FIELD_FORMS.get(field, 'a value of the documented type')}", ".".join(path)
        path.append(str(part))
    param = ".".join(path) or None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-openai", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repo", type=Path, required=True, help="the dflash-build repository being served (tokenizer, chat template)"
    )
    parser.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC host:port, or a fleet balancer's")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=port_number, default=9000)
    parser.add_argument("--served-model-name", help="the model id clients send (default: the target's directory name)")
    parser.add_argument("--default-max-tokens", type=int, default=16, help="when a request sets none (OpenAI's default: 16)")
    parser.add_argument(
        "--tokenizer", help="the target's tokenizer (a directory or hub id): needed for a --backend trtllm repository"
    )
    args = parser.parse_args(argv)
    require_at_least(parser, {"--default-max-tokens": (args.default_max_tokens, 1)})
    try:
        frontend = Frontend(args.repo, args.triton_url, args.served_model_name, args.default_max_tokens, args.tokenizer)
    except (FileNotFoundError, KeyError, OSError) as failure:
        print(f"dflash-openai: error: {args.repo} is not a dflash-build repository ({failure})", file=sys.stderr)
        return 2
    except ValueError as refusal:
        print(f"dflash-openai: error: {args.repo}: {refusal}", file=sys.stderr)
        return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print("dflash-openai: error: it needs FastAPI and uvicorn: pip install 'dflash-trt[serve]'", file=sys.stderr)
        return 2

    print(
        f"dflash-openai: serving {frontend.model!r} on http://{args.host}:{args.port}/v1 -> Triton {args.triton_url}",
        file=sys.stderr,
    )
    uvicorn.run(create_app(frontend), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
