"""Loading built engines: an engine directory (dflash/1/engine of a model repository) -> a GraphEngine."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from dflash_trt.builder.repository import MANIFEST
from dflash_trt.runtime.engine import EngineSpec, GraphEngine
from dflash_trt.runtime.graph_io import GRAPH_SCHEMA
from dflash_trt.runtime.onnxruntime_runner import OnnxRuntimeRunner, SessionSettings
from dflash_trt.runtime.tensorrt_runner import TensorRTRunner, tensorrt_runtime_available


def read_manifest(engine_dir: Path) -> dict[str, Any]:
    """The manifest beside the engines, or a repository's own where it has no engines (--backend trtllm)."""
    path = engine_dir / "manifest.json"
    if not path.is_file() and (engine_dir / MANIFEST).is_file():
        path = engine_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{engine_dir} has no manifest.json: it is not a (complete) dflash-build engine directory; build one with "
            f"dflash-build --output {engine_dir}, or pass the directory dflash-build wrote"
        )
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


SERVABLE = {"onnxruntime": "cpu", "torch-cuda": "cuda", "tensorrt": "cuda"}  # backends the runtime runs, and where
TORCH_DEVICE_ENV = "DFLASH_TRT_TORCH_DEVICE"  # "cpu": run a torch-cuda repository's graphs on the CPU (tests)
TORCH_ENGINE_DIRS = ("target", "drafter")  # a torch-cuda engine directory: the pair's checkpoints, as given


def check_servable(manifest: dict[str, Any], where: Path, device: str | None = None) -> None:
    """Refuse, with what to do, a repository whose engines this runtime cannot run here."""
    backend = manifest.get("backend")
    if backend == "trtllm":
        served = manifest.get("tensorrt_llm", {})
        raise RuntimeError(
            f"{where} is a TensorRT-LLM repository (dflash-build --backend trtllm, {manifest.get('parallel', {}).get('gpus')} "
            f"GPU(s)): TensorRT-LLM {served.get('release')} serves it, not this runtime. Run {where}/launch.sh inside "
            f"{served.get('container')} on GPUs with the project installed; dflash-client and dflash-bench then talk to it"
        )
    if backend not in SERVABLE:
        raise RuntimeError(
            f"{where} holds {backend} engines (device {manifest.get('device', 'cuda')}); this runtime serves "
            f"{', '.join(SERVABLE)} engines only so far: rebuild with dflash-build --backend onnxruntime (CPU) "
            "or --backend torch-cuda (GPU)"
        )
    if backend == "torch-cuda":
        torch_device(device)
    if backend == "tensorrt" and not tensorrt_runtime_available():
        raise RuntimeError(
            f"{where} holds TensorRT plans: serving them needs TensorRT 10+ and a CUDA GPU (the NVIDIA Triton "
            "container on a GPU); rebuild with dflash-build --backend torch-cuda (GPU) or --backend onnxruntime (CPU)"
        )
    if backend != "torch-cuda":  # its graphs are files, which must follow this runtime's schema (torch-cuda's are code)
        check_graph_schema(manifest, where)


def check_graph_schema(manifest: dict[str, Any], where: Path) -> None:
    """Refuse graphs built for another version of the graph schema (inputs and outputs the runtime would not match)."""
    built = manifest.get("graph_schema", "unrecorded (older than schema 3)")
    if built != GRAPH_SCHEMA:
        raise RuntimeError(
            f"{where} holds graphs of graph schema {built}, built by dflash-trt {manifest.get('dflash_trt_version')}; "
            f"this runtime serves schema {GRAPH_SCHEMA}: rebuild the repository with this version's dflash-build "
            "(the same command, with --force)"
        )


def torch_device(requested: str | None = None) -> torch.device:
    """Where a torch-cuda engine runs: `requested`, else $DFLASH_TRT_TORCH_DEVICE, else the GPU."""
    device = torch.device(requested or os.environ.get(TORCH_DEVICE_ENV) or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "this repository holds torch-cuda engines and torch sees no CUDA GPU here: serve it on a GPU machine, "
            f"rebuild with --backend onnxruntime for the CPU, or set {TORCH_DEVICE_ENV}=cpu to run its graphs on the "
            "CPU (slow; for tests)"
        )
    return device


def engine_dir_of(path: Path) -> Path:
    """Accept a model repository or its engine directory."""
    nested = path / "dflash" / "1" / "engine"
    return nested if nested.is_dir() else path


def engine_bytes(path: Path) -> int:
    """Bytes on disk of an engine directory (graphs, weights, manifest)."""
    return sum(f.stat().st_size for f in engine_dir_of(path).rglob("*") if f.is_file())


def load_engine(
    path: Path,
    threads: int | None = None,
    max_batch: int | None = None,
    device: str | None = None,
    reuse_prefixes: bool = True,
) -> tuple[GraphEngine, dict[str, Any]]:
    """The engine a dflash-build output holds (ONNX Runtime; torch-cuda on `device`, default the GPU), with a state
    pool of `max_batch` slots (default: the build's --max-batch-size), reusing prompt prefixes unless told not to."""
    engine_dir = engine_dir_of(path)
    manifest = read_manifest(engine_dir)
    check_servable(manifest, engine_dir, device)
    spec = EngineSpec.from_json(manifest["engine"])
    if manifest["backend"] == "torch-cuda":
        engine = load_torch_engine(engine_dir, spec, max_batch, torch_device(device))
    elif manifest["backend"] == "tensorrt":
        gpu = torch.device("cuda")
        engine = GraphEngine(TensorRTRunner(engine_dir, spec, gpu), spec, max_batch, gpu)
    else:
        runner = OnnxRuntimeRunner(engine_dir, spec.states, session_settings(manifest, threads), single_rows_padded(manifest))
        engine = GraphEngine(runner, spec, max_batch)
    engine.reuse_prefixes = reuse_prefixes
    return engine, manifest


def single_rows_padded(manifest: dict[str, Any]) -> bool:
    """Whether this CPU runs the engine's quantized target with one-row calls padded to two (see the runner)."""
    from dflash_trt.builder.quantize import MODES, pad_single_rows

    return pad_single_rows(MODES[manifest.get("quantization", {}).get("mode", "none")])


def session_settings(manifest: dict[str, Any], threads: int | None = None) -> SessionSettings:
    """The ONNX Runtime session settings of a build, with `threads` intra-op threads instead when given."""
    settings = SessionSettings(**manifest["session"])
    return settings if threads is None else SessionSettings(threads, settings.graph_optimization)


def load_torch_engine(engine_dir: Path, spec: EngineSpec, max_batch: int | None, device: torch.device) -> GraphEngine:
    """The pair's checkpoints in the engine directory, loaded in the engine's dtype, their graphs run by torch."""
    from dflash_trt.builder.graphs import torch_engine
    from dflash_trt.builder.networks import load_pair

    target, drafter = load_pair(engine_dir / "target", engine_dir / "drafter", spec.torch_dtype)
    return torch_engine(target, drafter, spec.max_seq_len, spec.block_size, max_batch or spec.max_batch_size, device)
