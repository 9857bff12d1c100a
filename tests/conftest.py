"""Fixtures: tiny random checkpoints written with transformers' own save_pretrained, and drafters in z-lab format."""

from __future__ import annotations

import json
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
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on CPU tensors (read when triton is imported)

from dflash_trt.builder.checkpoints import parse_target_config, read_config_json  # noqa: E402
from dflash_trt.builder.cli import EXPORT_CACHE_ENV  # noqa: E402
from dflash_trt.builder.drafter_init import drafter_config_dict, init_drafter, save_drafter  # noqa: E402
from dflash_trt.runtime.serve import Ports, dead_backend_stubs, free_port, start_server, stop_server, wait_ready  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=None,
    bos_token_id=0,
    pad_token_id=None,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=24, rope_theta=1e6, tie_word_embeddings=False),
}


def write_tiny_tokenizer(output_dir: Path, vocab_size: int = 96) -> None:
    """A word-level tokenizer over `<s>`, then `w1` .. `w{V-1}` (whitespace-separated), in HF's tokenizer.json format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<s>").save_pretrained(output_dir)


def all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and, recursively, those of its `If` branches (which read outer-scope values)."""
    branches = [b for node in graph.node for a in node.attribute for b in ([a.g] if a.HasField("g") else a.graphs)]
    return [*graph.node, *(node for branch in branches for node in all_nodes(branch))]


def peak_weights(model: torch.nn.Module, std: float) -> None:
    """Larger-than-default random weights, so a tiny model's logits are peaked enough to be a meaningful check (greedy
    choices far from ties); norms and Gated DeltaNet decays (A_log, dt_bias) keep their initial values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not any(part in name for part in ("norm", "A_log", "dt_bias")):
                param.normal_(0.0, std)


def write_tiny_target(model_type: str, output_dir: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = CONFIGS[model_type]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    peak_weights(model, 0.08)
    model.save_pretrained(output_dir)
    write_tiny_tokenizer(output_dir, config.vocab_size)
    return output_dir


def write_tiny_drafter(target_dir: Path, output_dir: Path, seed: int = 1, **overrides: object) -> Path:
    target = parse_target_config(read_config_json(target_dir))
    config = drafter_config_dict(target, num_layers=2, block_size=16)
    config.update(overrides)
    network = init_drafter(config, seed=seed, std=0.08)
    save_drafter(network, config, output_dir)
    return output_dir


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
    return {name: write_tiny_target(name, root / name) for name in CONFIGS}


@pytest.fixture(scope="session")
def tiny_drafter(tiny_targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_drafter(tiny_targets["llama"], tmp_path_factory.mktemp("drafter") / "llama-dflash")


@pytest.fixture(scope="session")
def trained_drafter(tiny_targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drafter briefly trained on the qwen3 tiny target's own greedy continuations, so long runs get accepted."""
    from dflash_trt.builder.networks import load_drafter, load_target
    from dflash_trt.builder.training import TrainSettings, generate_responses, make_examples, train_drafter

    untrained = write_tiny_drafter(tiny_targets["qwen3"], tmp_path_factory.mktemp("untrained") / "d")
    drafter = load_drafter(untrained)
    target = load_target(tiny_targets["qwen3"], drafter.config.target_layer_ids)
    prompts = torch.randint(1, 90, (64, 16), generator=torch.Generator().manual_seed(0))
    sequences = generate_responses(target, prompts.tolist(), 64)
    examples = make_examples(target, list(sequences), [1] * len(sequences))
    train_drafter(drafter, target, examples, TrainSettings(steps=300, compute_dtype=torch.float32))  # AVX2: see compute_dtype
    output = tmp_path_factory.mktemp("trained") / "d"
    config = json.loads((untrained / "config.json").read_text())
    save_drafter(drafter, config, output)
    return output


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
