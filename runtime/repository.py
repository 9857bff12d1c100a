"""Loading built engines: an engine directory (dflash/1/engine of a model repository) -> a GraphEngine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_trt.runtime.engine import EngineSpec, GraphEngine
from dflash_trt.runtime.onnxruntime_runner import OnnxRuntimeRunner, SessionSettings


def read_manifest(engine_dir: Path) -> dict[str, Any]:
    path = engine_dir / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{engine_dir} has no manifest.json: it is not a (complete) dflash-build engine directory")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


SERVABLE = {"onnxruntime": "cpu"}  # backends this runtime can run, and the device each runs on


def check_servable(manifest: dict[str, Any], where: Path) -> None:
    """Refuse, with what to do, a repository whose engines this runtime cannot run."""
    backend = manifest.get("backend")
    if backend not in SERVABLE:
        raise RuntimeError(
            f"{where} holds {backend} engines (device {manifest.get('device', 'cuda')}); this runtime serves "
            f"{', '.join(SERVABLE)} engines only so far: rebuild with dflash-build --backend onnxruntime"
        )


def engine_dir_of(path: Path) -> Path:
    """Accept a model repository or its engine directory."""
    nested = path / "dflash" / "1" / "engine"
    return nested if nested.is_dir() else path


def engine_bytes(path: Path) -> int:
    """Bytes on disk of an engine directory (graphs, weights, manifest)."""
    return sum(f.stat().st_size for f in engine_dir_of(path).iterdir() if f.is_file())


def load_engine(path: Path, threads: int | None = None, max_batch: int | None = None) -> tuple[GraphEngine, dict[str, Any]]:
    """The engine a dflash-build output holds (ONNX Runtime here; TensorRT plans where TensorRT runs), with a state
    pool of `max_batch` slots (default: the build's --max-batch-size)."""
    engine_dir = engine_dir_of(path)
    manifest = read_manifest(engine_dir)
    spec = EngineSpec.from_json(manifest["engine"])
    check_servable(manifest, engine_dir)
    settings = SessionSettings(**manifest["session"])
    if threads is not None:
        settings = SessionSettings(threads, settings.graph_optimization)
    runner = OnnxRuntimeRunner(engine_dir, spec.states, settings)
    return GraphEngine(runner, spec, max_batch), manifest
