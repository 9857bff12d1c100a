"""dflash-openai for real: tritonserver on the tiny repository (given a chat template), the front end in its own
process, and the real `openai` Python client."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.client.triton_client import Request, stream_text
from dflash_trt.runtime.loop import generate
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.serve import Ports
from transformers import AutoTokenizer

from tests.conftest import openai_front_end, running_server

pytestmark = pytest.mark.slow
TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
PROMPT = "w5 w35 w89 w7"
OTHER_PROMPT = "w12 w9 w40"


@pytest.fixture(scope="module")
def chat_repo(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("chat") / "repo"
    shutil.copytree(tiny_repo, repo)
    config_path = repo / TOKENIZER_DIR / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return repo


@pytest.fixture(scope="module")
def triton(chat_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    with running_server(chat_repo, tmp_path_factory.mktemp("triton")) as ports:
        yield ports


@pytest.fixture(scope="module")
def client(chat_repo: Path, triton: Ports) -> Iterator[openai.OpenAI]:
    with openai_front_end(chat_repo, triton.grpc) as front:
        yield front


def test_completions_equal_the_engine_streaming_or_not(client: openai.OpenAI, chat_repo: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_repo / TOKENIZER_DIR)
    engine, _ = load_engine(chat_repo)
    ids = tokenizer(PROMPT)["input_ids"]
    expected = tokenizer.decode(generate(engine, ids, 24).tokens, skip_special_tokens=True)
    [model] = client.models.list().data
    whole = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 24)
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=model.id, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_applies_the_template_and_equals_dflash_client(client: openai.OpenAI, triton: Ports) -> None:
    """The ensemble applies the same template to dflash-client's prompt; usage reports the prompt tokens reused
    (OpenAI's `prompt_tokens_details.cached_tokens`)."""
    expected = "".join(r["text"] for r in stream_text(f"localhost:{triton.grpc}", PROMPT, Request(20)))
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="", messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    details = chunks[-1].usage.prompt_tokens_details  # the same conversation again: all but its last token reused
    assert details is not None and details.cached_tokens == chunks[-1].usage.prompt_tokens - 1


def test_stop_strings_are_cut_from_the_text(client: openai.OpenAI) -> None:
    full = client.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full.split()[3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        answer = client.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=stream)
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == cut  # type: ignore[union-attr]
        assert chunks[-1].choices[0].finish_reason == "stop"  # type: ignore[union-attr]


def test_a_prompt_as_token_ids_is_the_same_prompt(client: openai.OpenAI, chat_repo: Path) -> None:
    """OpenAI's `prompt` may be token ids (one list, or a list holding one): the same completion as the text."""
    ids = AutoTokenizer.from_pretrained(chat_repo / TOKENIZER_DIR)(PROMPT)["input_ids"]
    expected = client.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0)
    for prompt in (ids, [ids]):
        answer = client.completions.create(model="", prompt=prompt, max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected.choices[0].text
        assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)


def test_n_choices_of_each_prompt_at_once(client: openai.OpenAI, chat_repo: Path) -> None:
    """n choices of each prompt of a list, in OpenAI's order (choice i of prompt i // n), generated at once: greedy
    ones equal the engine's output for their prompt; sampled choice j of a seeded request equals that request sent
    alone with seed + j, streamed or answered whole; usage counts each prompt once and every choice's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(chat_repo / TOKENIZER_DIR)
    engine, _ = load_engine(chat_repo)
    prompts = [PROMPT, OTHER_PROMPT]
    expected = [
        tokenizer.decode(generate(engine, tokenizer(p)["input_ids"], 12).tokens, skip_special_tokens=True) for p in prompts
    ]
    greedy = client.completions.create(model="", prompt=prompts, n=2, max_tokens=12, temperature=0)
    assert [(c.index, c.text) for c in greedy.choices] == [(i, expected[i // 2]) for i in range(4)]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert greedy.usage is not None and (greedy.usage.prompt_tokens, greedy.usage.completion_tokens) == (sum(lengths), 48)

    alone = [
        client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7 + j).choices[0].text
        for j in range(3)
    ]
    assert len(set(alone)) > 1, "three seeds gave one sample: the test would prove nothing"
    whole = client.completions.create(model="", prompt=PROMPT, n=3, max_tokens=16, temperature=1.0, seed=7)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == alone
    streamed = ["", "", ""]
    for chunk in client.completions.create(model="", prompt=PROMPT, n=3, max_tokens=16, temperature=1.0, seed=7, stream=True):
        for part in chunk.choices:
            streamed[part.index] += part.text
    assert streamed == alone
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": PROMPT}],
        n=2,
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    roles, contents = [[], []], ["", ""]
    for chunk in chat:
        for part in chunk.choices:
            roles[part.index] += [part.delta.role] if part.delta.role else []
            contents[part.index] += part.delta.content or ""
    assert roles == [["assistant"], ["assistant"]] and contents[0] == contents[1] != ""


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"n": 0}, "n: Input should be greater than or equal to 1"),
        ({"prompt": [PROMPT] * 40, "n": 4}, "40 prompts x n=4: give 1 to 128 choices"),
        ({"best_of": 2}, "best_of=2 is not supported"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 100000}, "exceeds the maximum sequence length"),
        ({"stop": 5}, "stop: give a string or a list of up to 4 strings"),
        ({"prompt": 5}, "prompt: give a string or token ids"),
        ({"prompt": [3, -4]}, "prompt token ids [-4] are not in the tokenizer's vocabulary"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(client: openai.OpenAI, fields: dict[str, object], named: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**{"model": "", "prompt": PROMPT, "max_tokens": 8, **fields})  # type: ignore[call-overload]
    error = raised.value.body
    assert isinstance(error, dict) and named in error["message"] and error["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=8)


@pytest.mark.parametrize(("stream", "n"), [(True, 1), (False, 1), (True, 12)])
def test_a_client_that_leaves_frees_its_slot(client: openai.OpenAI, triton: Ports, chat_repo: Path, stream: bool, n: int) -> None:
    """An HTTP client gone mid-answer (streamed: after its first event; answered whole: once its request runs, as a
    client timeout would) cancels its requests on the server at once (all n choices', those still waiting for one of
    the 8 slots too), long before the tokens it asked for (the counter counts a request's tokens when it ends).
    Before, a streamed request ran on until a garbage collection closed its stream, and one answered whole ran to
    its end."""
    tokenizer = AutoTokenizer.from_pretrained(chat_repo / TOKENIZER_DIR)
    engine, _ = load_engine(chat_repo)
    asked = 200
    alone = generate(engine, tokenizer(PROMPT)["input_ids"], asked).tokens  # what the request would generate
    assert len(alone) == asked, "the prompt ends by itself: the test would prove nothing"
    metrics = f"http://localhost:{triton.metrics}/metrics"
    generated = _metric(metrics, "dflash_generated_tokens_total")
    body = {"model": "", "prompt": PROMPT, "max_tokens": asked, "temperature": 0, "stream": stream, "n": n}
    front = urllib.parse.urlsplit(str(client.base_url))
    connection = http.client.HTTPConnection(front.hostname or "", front.port, timeout=60)
    connection.request("POST", f"{front.path}completions", json.dumps(body), {"content-type": "application/json"})
    if stream:
        assert connection.getresponse().readline().startswith(b"data: ")
    else:
        _wait_for(lambda: _metric(metrics, "dflash_running_requests") == 1, "the request never ran")
    connection.close()
    _wait_for(lambda: _metric(metrics, "dflash_running_requests") == 0, "the request went on after its client left")
    _wait_for(lambda: _metric(metrics, "dflash_waiting_requests") == 0, "a choice still waits after its client left")
    assert _metric(metrics, "dflash_generated_tokens_total") - generated < n * asked / 2


def _wait_for(condition: Callable[[], bool], failure: str, seconds: float = 10.0) -> None:
    deadline = time.perf_counter() + seconds
    while not condition():
        assert time.perf_counter() < deadline, failure
        time.sleep(0.005)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_a_body_that_is_not_json_is_named_so(client: openai.OpenAI) -> None:
    body = urllib.request.Request(
        f"{client.base_url}completions", data=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(body, timeout=30)
    assert answer.value.code == 400
    error = json.loads(answer.value.read())["error"]
    assert error["message"] == "the request body is not valid JSON (Expecting value at character 11)"
