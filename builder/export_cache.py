"""The export cache: float ONNX graphs kept from one build and reused by the next build of the same pair.

Tracing the four graphs is most of a build's time (about 4 minutes for a tiny pair, 11 for SmolLM2-135M on 2
cores; far more for a 27B target), and it does not depend on what is decided after it: the quantization mode,
`--max-batch-size` (the pool's slot axis is dynamic in every graph), the thread count, the chat-template switch.
With `dflash-build --export-cache DIR` the float graphs of a build are kept under DIR, keyed by everything that
does decide them, and a later build with the same key quantizes and packages them instead of tracing again.

The key: sha256 of the target's and the drafter's config.json and safetensors files (the manifest's own
provenance hashes), the engine description less its batch size (block size, --max-seq-len, dtype, vocabulary,
states), the source of this toolkit's builder, plugins and runtime packages, and the versions of the libraries that
trace and rewrite (torch, onnxscript, onnx-ir, onnx). An entry is written under a temporary name and renamed into
place when complete, so a killed build never leaves an entry that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

from dflash_trt import builder, plugins, runtime
from dflash_trt.runtime.engine import EngineSpec

TRACING_LIBRARIES = ("torch", "onnxscript", "onnx-ir", "onnx")
KEY_FILE = "key.json"


def source_fingerprint() -> str:
    """sha256 of every Python source of the packages that decide the graphs (builder, plugins, runtime)."""
    digest = hashlib.sha256()
    for package in (builder, plugins, runtime):
        root = Path(package.__file__).parent  # type: ignore[arg-type]
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def key_record(spec: EngineSpec, target_hashes: dict[str, str], drafter_hashes: dict[str, str]) -> dict[str, Any]:
    """Everything that decides the float graphs (and nothing that does not, such as the batch size)."""
    engine = {k: v for k, v in spec.to_json().items() if k != "max_batch_size"}
    return {
        "target_sha256": target_hashes,
        "drafter_sha256": drafter_hashes,
        "engine": engine,
        "sources_sha256": source_fingerprint(),
        "libraries": {name: version(name) for name in TRACING_LIBRARIES},
    }


def cache_key(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]


class ExportCache:
    """A directory of float exports, one subdirectory per key (the graphs, weights.bin and key.json)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def entry(self, record: dict[str, Any]) -> Path:
        return self.root / cache_key(record)

    def lookup(self, record: dict[str, Any]) -> Path | None:
        """The entry for `record` if a complete one exists (its key.json is written last)."""
        entry = self.entry(record)
        return entry if (entry / KEY_FILE).is_file() else None

    @contextmanager
    def storing(self, record: dict[str, Any]) -> Iterator[Path]:
        """Yield a directory to export into; on success it becomes the entry for `record`, on failure it is removed."""
        entry = self.entry(record)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{entry.name}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            yield staging
            (staging / KEY_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            try:
                staging.rename(entry)
            except OSError:  # another build stored the same key meanwhile: its entry is as good as ours
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def cached_export(cache: ExportCache, record: dict[str, Any], export: Callable[[Path], object]) -> Path:
    """The cache entry for `record`, exported into the cache by `export(directory)` first if it is not there."""
    found = cache.lookup(record)
    if found is not None:
        print(
            f"[dflash-build] export cache hit: {found} (float graphs of an earlier build of this pair and options)",
            file=sys.stderr,
        )
        return found
    print(f"[dflash-build] export cache miss: exporting into {cache.entry(record)}", file=sys.stderr)
    with cache.storing(record) as staging:
        export(staging)
    return cache.entry(record)
