"""The real embedded pair served for real: SmolLM2-135M engines behind tritonserver, HumanEval prompts, T=0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dflash_trt.builder.cli import main as dflash_build
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.client.triton_client import Request, http_generate_stream, stream_text, stream_tokens
from dflash_trt.runtime.baselines import BaselineJob, run_baseline
from dflash_trt.runtime.loop import generate, generate_plain
from dflash_trt.runtime.prompts import encode_prompt, humaneval_prompts
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.serve import Ports
from transformers import AutoTokenizer

from tests.conftest import running_server

pytestmark = pytest.mark.slow
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("smollm2") / "repo"
    assert dflash_build(["--model", "smollm2-135m", "--output", str(output), "--max-seq-len", "512"]) == 0
    return output


@pytest.fixture(scope="module")
def server(smollm2_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    with running_server(smollm2_repo, tmp_path_factory.mktemp("triton")) as ports:
        yield ports


def test_humaneval_streams_equal_the_in_process_engine(smollm2_repo: Path, server: Ports) -> None:
    engine, _ = load_engine(smollm2_repo)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_repo / TOKENIZER_DIR)
    for text in humaneval_prompts(5):
        ids = encode_prompt(tokenizer, text)
        expected = generate(engine, ids, MAX_TOKENS).tokens
        served = [t for r in stream_tokens(f"localhost:{server.grpc}", ids, Request(MAX_TOKENS)) for t in r["tokens"]]
        assert served == expected
        expected_text = tokenizer.decode(expected, skip_special_tokens=True)
        assert "".join(r["text"] for r in stream_text(f"localhost:{server.grpc}", text, Request(MAX_TOKENS))) == expected_text
        assert (
            "".join(r["text"] for r in http_generate_stream(f"http://localhost:{server.http}", text, Request(MAX_TOKENS)))
            == expected_text
        )


def test_transformers_baseline_decodes_as_the_engine_does(smollm2_repo: Path) -> None:
    """HumanEval/9: the target ends its turn at new token 77. The engine decodes on past it (fixed length, no stop
    tokens), so `dflash-bench --against transformers` must too, without suppressing the end-of-turn token, and
    without generate() masking the prompt's own end-of-turn tokens (SmolLM2's pad token) as padding."""
    engine, manifest = load_engine(smollm2_repo)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_repo / TOKENIZER_DIR)
    prompt = encode_prompt(tokenizer, humaneval_prompts(10)[9])
    assert tokenizer.pad_token_id in prompt
    expected = generate_plain(engine, prompt, 80).tokens
    assert tokenizer.eos_token_id in expected
    job = BaselineJob("transformers", manifest["target"]["source"], manifest["drafter"]["source"], [prompt], 80, 0.0)
    assert run_baseline(job, threads=2).outputs == [expected]
