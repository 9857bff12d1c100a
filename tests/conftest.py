"""Fixtures: tiny random checkpoints written with transformers' own save_pretrained, and drafters in z-lab format."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import openai
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on CPU tensors (read when triton is imported)

from dflash_trt.builder.cli import EXPORT_CACHE_ENV  # noqa: E402
from dflash_trt.builder.tiny_checkpoints import (  # noqa: E402
    MODEL_TYPES,
    write_tiny_drafter,
    write_tiny_target,
    write_trained_tiny_drafter,
)
from dflash_trt.runtime.serve import Ports, dead_backend_stubs, free_port, start_server, stop_server, wait_ready  # noqa: E402


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and, recursively, those of its `If` branches (which read outer-scope values)."""
    branches = [b for node in graph.node for a in node.attribute for b in ([a.g] if a.HasField("g") else a.graphs)]
    return [*graph.node, *(node for branch in branches for node in all_nodes(branch))]


@pytest.fixture(scope="session", autouse=True)
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every build of the run keeps its float graphs here (dflash-build --export-cache), so builds of one pair and
    options that differ only after the export (quantization, batch size) trace once. tests/test_build.py builds
    without it and checks that the cache gives the bytes an export writes."""
    path = tmp_path_factory.mktemp("export-cache")
    os.environ[EXPORT_CACHE_ENV] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {name: write_tiny_target(name, root / name) for name in MODEL_TYPES}


@pytest.fixture(scope="session")
def tiny_drafter(tiny_targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_drafter(tiny_targets["llama"], tmp_path_factory.mktemp("drafter") / "llama-dflash")


@pytest.fixture(scope="session")
def trained_drafter(tiny_targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter briefly trained on the qwen3 tiny target's own greedy continuations, so long runs get accepted."""
    work = tmp_path_factory.mktemp("trained")
    return write_trained_tiny_drafter(tiny_targets["qwen3"], work / "d", work)


@pytest.fixture(scope="session")
def tiny_repo(tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dflash-build model repository (ONNX Runtime engines) of the tiny qwen3 target and its trained drafter."""
    from dflash_trt.builder.cli import main as dflash_build

    output = tmp_path_factory.mktemp("repository") / "tiny"
    command = [
        "--model",
        str(tiny_targets["qwen3"]),
        "--drafter",
        str(trained_drafter),
        "--output",
        str(output),
        "--max-seq-len",
        "256",
    ]
    assert dflash_build(command) == 0
    return output


@contextmanager
def running_server(repo: Path, log_dir: Path, unary: bool = False) -> Iterator[Ports]:
    """A real tritonserver on `repo` at free loopback ports, stopped (cleanly) afterwards."""
    ports = Ports(free_port(), free_port(), free_port())
    log = log_dir / "server.log"
    process = start_server(repo, ports, log, unary=unary)
    try:
        wait_ready(process, ports.http)
        yield ports
    finally:
        dead_stubs = dead_backend_stubs(process.pid)
        code = stop_server(process)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        assert not dead_stubs, f"Python-backend stubs died while the tests ran (pids {dead_stubs}); the end of {log}:\n{tail}"
        assert code == 0, f"tritonserver exited with code {code}; the end of {log}:\n{tail}"


@contextmanager
def openai_front_end(repo: Path, triton_grpc: int, *extra: str) -> Iterator[openai.OpenAI]:
    """dflash-openai on `repo` in its own process, fronting tritonserver's gRPC port; the real `openai` client on it."""
    port = free_port()
    command = [sys.executable, "-m", "dflash_trt.client.openai_api", "--repo", str(repo), "--port", str(port),
               "--triton-url", f"localhost:{triton_grpc}", "--host", "127.0.0.1", *extra]  # fmt: skip
    front = subprocess.Popen(command)
    try:
        deadline = time.perf_counter() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
                    break
            except OSError:
                assert front.poll() is None and time.perf_counter() < deadline, "dflash-openai did not start"
                time.sleep(0.2)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        front.terminate()
        front.wait(10)
