"""The torch-cuda backend: a repository holding the pair's checkpoints, whose graphs torch runs on a GPU. No GPU
here, so its code path runs in its test mode (the same graphs and runner, device "cpu") and must equal the ONNX
Runtime engine of the same pair; without that mode, a machine without CUDA refuses it with what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash_trt.builder.cli import main as dflash_build
from dflash_trt.client.triton_client import Request, stream_tokens
from dflash_trt.runtime.loop import generate
from dflash_trt.runtime.repository import TORCH_DEVICE_ENV, load_engine
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.serve import main as dflash_serve

from tests.conftest import running_server

PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 89], [7, 7, 7, 1, 2, 3, 4, 60, 61]]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def torch_repo(tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("torch-cuda") / "repo"
    command = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--output", str(output)]
    assert dflash_build([*command, "--backend", "torch-cuda", "--dtype", "float32", "--max-seq-len", "256"]) == 0
    return output


def test_the_repository_holds_the_checkpoints_and_says_it_needs_a_gpu(torch_repo: Path) -> None:
    manifest = json.loads((torch_repo / "dflash-manifest.json").read_text())
    assert (manifest["backend"], manifest["device"], manifest["engine"]["dtype"]) == ("torch-cuda", "cuda", "float32")
    engine_dir = torch_repo / "dflash/1/engine"
    assert {p.name for p in engine_dir.iterdir()} == {"target", "drafter", "manifest.json"}
    assert (engine_dir / "target/model.safetensors").is_file() and (engine_dir / "drafter/config.json").is_file()


@no_cuda
def test_without_cuda_it_is_refused_with_what_to_do(torch_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TORCH_DEVICE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"no CUDA GPU.*--backend onnxruntime.*{TORCH_DEVICE_ENV}=cpu"):
        load_engine(torch_repo)
    assert dflash_serve([str(torch_repo), "--grpc-port", "1", "--http-port", "2", "--metrics-port", "3"]) == 2


def test_its_graphs_on_the_cpu_equal_the_onnxruntime_engine(torch_repo: Path, tiny_repo: Path) -> None:
    """tiny_repo is the same pair built for ONNX Runtime (float32, --max-seq-len 256)."""
    on_torch, _ = load_engine(torch_repo, device="cpu")
    on_onnxruntime, _ = load_engine(tiny_repo)
    for prompt in PROMPTS:
        expected = generate(on_onnxruntime, prompt, 48)
        got = generate(on_torch, prompt, 48)
        assert got.tokens == expected.tokens
        assert got.stats.accepted_draft_tokens == expected.stats.accepted_draft_tokens
    seeded = SamplingParams(0.8, top_k=20, seed=3)
    assert len(generate(on_torch, PROMPTS[0], 32, seeded).tokens) == 32


@pytest.mark.slow
def test_the_dflash_model_serves_it(
    torch_repo: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TORCH_DEVICE_ENV, "cpu")  # tritonserver inherits it
    engine, _ = load_engine(torch_repo)
    expected = [generate(engine, p, 40).tokens for p in PROMPTS]
    with running_server(torch_repo, tmp_path_factory.mktemp("triton-torch")) as ports:
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            served = [t for r in stream_tokens(f"localhost:{ports.grpc}", prompt, Request(40)) for t in r["tokens"]]
            assert served == tokens


def test_cuda_graphs_are_refused_off_a_cuda_device() -> None:
    """The torch-cuda runner captures its batched graphs only on a GPU (on the CPU, in this test mode, it runs them
    eagerly); asked to capture elsewhere, it says why."""
    from dflash_trt.runtime.cuda_graphs import CudaGraphCalls

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        CudaGraphCalls(torch.device("cpu"))


def test_batch_buckets_are_powers_of_two_then_multiples_of_eight_within_the_limit() -> None:
    from dflash_trt.runtime.cuda_graphs import BatchPadding

    padding = BatchPadding((0,), (0,), limit=64)
    rows = [1, 2, 3, 5, 8, 9, 13, 16, 17, 57, 64, 65]
    assert [padding.bucket(r) for r in rows] == [1, 2, 4, 8, 8, 16, 16, 16, 24, 64, 64, 65]
    assert BatchPadding((0,), (0,), limit=12).bucket(9) == 12  # a plan's profile ends at the build's batch limit


class EagerCaptures:
    """What the GPU runners call for their batched graphs (`CudaGraphCalls.run`), run eagerly: the batch padding it
    applies, without CUDA."""

    def __init__(self) -> None:
        self.rows_run: list[int] = []

    def run(self, name: str, body, values, padding):  # type: ignore[no-untyped-def]
        def eager(padded: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            self.rows_run.append(int(padded[0].shape[0]))
            return body(*padded)

        return padding.call(eager, values)


def test_padded_batches_give_every_sequence_the_tokens_of_unpadded_ones(torch_repo: Path) -> None:
    """The runner pads a batched call to its bucket (5 sequences run as 8, repeating the first row) and cuts the
    outputs back before the engine writes rows into the pool: every sequence gets the tokens it gets unpadded, greedy
    or sampled, drafting or plain."""
    from dflash_trt.runtime.loop import Sequence
    from dflash_trt.runtime.scheduler import FixedVerify, PlainDecoding, Scheduler

    prompts = [*PROMPTS, [11, 12, 13, 14], [40, 41]]
    greedy = SamplingParams()
    samplings = [SamplingParams(0.8, top_k=20, seed=3), greedy, greedy, greedy, SamplingParams(1.0, seed=5)]  # row 0 padded

    def batched(engine, policy) -> list[list[int]]:  # type: ignore[no-untyped-def]
        scheduler = Scheduler(engine, policy)
        sequences = [Sequence(p, 24, s) for p, s in zip(prompts, samplings, strict=True)]
        for sequence in sequences:
            scheduler.submit(sequence)
        while scheduler.busy:
            scheduler.step()
        return [s.tokens for s in sequences]

    unpadded, _ = load_engine(torch_repo, device="cpu")
    padded, _ = load_engine(torch_repo, device="cpu")
    captures = EagerCaptures()
    padded.runner.cuda_graphs = captures  # type: ignore[attr-defined]
    for policy in (lambda: FixedVerify(unpadded.block_size - 1), PlainDecoding):
        assert batched(padded, policy()) == batched(unpadded, policy())
    assert 8 in captures.rows_run and set(captures.rows_run) <= {1, 2, 4, 8}
