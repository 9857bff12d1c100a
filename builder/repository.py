"""Writing a Triton model repository: the model_repo/ templates filled in, engines, tokenizer, manifest.

Everything is built in a sibling staging directory and renamed into place at the end, so a failed or
killed build never leaves a directory that looks like a valid repository; the manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from string import Template
from typing import Any

from dflash_trt.builder.checkpoints import CheckpointError

TEMPLATES = Path(__file__).resolve().parent.parent / "model_repo"
MODELS = ("ensemble", "dflash")
UNARY_CONFIG = "unary"  # `tritonserver --model-config-name=unary`: the ensemble non-decoupled, for unary infer
MANIFEST = "dflash-manifest.json"  # top level of the repository (Triton ignores plain files there)
ENGINE_DIR = "engine"  # inside dflash/1/
TOKENIZER_DIR = "dflash/1/tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def templates_dir() -> Path:
    """model_repo/ beside the package sources (editable install) or inside the installed package."""
    if (TEMPLATES / "dflash" / "config.pbtxt").is_file():
        return TEMPLATES
    import dflash_trt.model_repo as packaged

    return Path(packaged.__file__).resolve().parent


def write_templates(repo: Path, values: dict[str, str], models: tuple[str, ...] = MODELS) -> None:
    """Copy the Triton models, substituting ${name} placeholders in their config.pbtxt. A model whose template has
    ${decoupled} gets config.pbtxt decoupled (streaming) and configs/unary.pbtxt not (unary infer), as
    tensorrtllm_backend's `decoupled_mode` switch does; `dflash-serve --unary` picks the second."""
    source = templates_dir()
    for model in models:
        (repo / model / "1").mkdir(parents=True, exist_ok=True)
        template = Template((source / model / "config.pbtxt").read_text())
        (repo / model / "config.pbtxt").write_text(template.substitute(values, decoupled="true"))
        if "${decoupled}" in template.template:
            (repo / model / "configs").mkdir(exist_ok=True)
            (repo / model / "configs" / f"{UNARY_CONFIG}.pbtxt").write_text(template.substitute(values, decoupled="false"))
        script = source / model / "1" / "model.py"
        if script.is_file():
            shutil.copy2(script, repo / model / "1" / "model.py")


def copy_tokenizer(checkpoint_dir: Path, repo: Path) -> None:
    files = [checkpoint_dir / name for name in TOKENIZER_FILES if (checkpoint_dir / name).is_file()]
    if not any(f.name in ("tokenizer.json", "vocab.json") for f in files):
        raise CheckpointError(
            f"{checkpoint_dir} has no tokenizer (tokenizer.json); the served model needs the target's tokenizer"
        )
    destination = repo / TOKENIZER_DIR
    destination.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy2(path, destination / path.name)


def link_checkpoint(checkpoint_dir: Path, destination: Path) -> list[Path]:
    """The checkpoint's files (config, weights, their index; not its subdirectories) into `destination`: hard links
    where the file system allows (no second copy of the weights), copies otherwise."""
    destination.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(checkpoint_dir.iterdir()):
        if not path.is_file():
            continue
        target = destination / path.name
        try:
            os.link(path.resolve(), target)  # resolved: a hub cache's files are symlinks to blobs
        except OSError:
            shutil.copy2(path, target)
        written.append(target)
    return written


def checkpoint_hashes(directory: Path) -> dict[str, str]:
    """sha256 of config.json and every safetensors file of a checkpoint (the manifest's provenance)."""
    hashes = {}
    for path in sorted([directory / "config.json", *directory.glob("*.safetensors")]):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
        hashes[path.name] = digest.hexdigest()
    return hashes


def write_manifest(repo: Path, manifest: dict[str, object]) -> None:
    record = {
        "dflash_trt_version": version("dflash-trt"),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **manifest,
    }
    text = json.dumps(record, indent=2) + "\n"
    engine_dir = repo / "dflash" / "1" / ENGINE_DIR
    if engine_dir.is_dir():  # beside the engines (a --backend trtllm repository has none)
        (engine_dir / "manifest.json").write_text(text)
    (repo / MANIFEST).write_text(text)  # last: its presence marks a complete repository


def is_complete_repository(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def read_repository_manifest(repo: Path) -> dict[str, Any]:
    """The manifest of a dflash-build repository (any backend)."""
    manifest: dict[str, Any] = json.loads((repo / MANIFEST).read_text())
    return manifest


@contextmanager
def staged_output(output: Path, force: bool) -> Iterator[Path]:
    """Yield a staging directory; on success it replaces `output`, on any failure it is removed."""
    if output.exists() and not force:
        raise FileExistsError(f"{output} already exists; pass --force to replace it or choose another --output")
    output.parent.mkdir(parents=True, exist_ok=True)
    for stale in output.parent.glob(f".{output.name}.partial-*"):  # left by a killed build
        shutil.rmtree(stale, ignore_errors=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)
    print(f"[dflash-build] model repository ready: {output}", file=sys.stderr)
