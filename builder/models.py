"""Where checkpoints come from: model aliases, local directories, and (only when asked) the Hugging Face hub."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trt.builder.checkpoints import CheckpointError, read_config_json
from dflash_trt.builder.embedded import EMBEDDED_TARGET, embedded_target_dir


@dataclass(frozen=True)
class ModelAlias:
    target: str  # HF hub id of the target
    drafter: str | None  # HF hub id of its z-lab DFlash drafter


ALIASES = {
    "qwen3.5-27b": ModelAlias("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash"),
    "qwen3.5-122b-a10b": ModelAlias("Qwen/Qwen3.5-122B-A10B", "z-lab/Qwen3.5-122B-A10B-DFlash"),
    "qwen3.5-397b-a17b": ModelAlias("Qwen/Qwen3.5-397B-A17B", "z-lab/Qwen3.5-397B-A17B-DFlash"),
    "qwen3.5-4b": ModelAlias("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash"),
    "qwen3-8b": ModelAlias("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
    "qwen3-4b": ModelAlias("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
    "llama-3.1-8b": ModelAlias("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
}
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
# The demo drafter for the embedded target, trained with dflash-train and shipped in the package (see its README).
EMBEDDED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-dflash"
# config.json of aliased pairs (no weights), for what needs configs only: --plan, --backend trtllm (see its README)
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def looks_like_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~"))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def _hub_config(repo_id: str) -> dict[str, Any] | None:
    """config.json of a hub checkpoint (nothing else is fetched), or None when offline and not cached."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return dict(json.loads(Path(hf_hub_download(repo_id, "config.json", local_files_only=True)).read_text()))
    except LocalEntryNotFoundError:
        if _hub_offline():
            return None
    return dict(json.loads(Path(hf_hub_download(repo_id, "config.json")).read_text()))


def _shipped_config(model: str, role: str) -> dict[str, Any] | None:
    """The shipped config.json of an alias's target or drafter (`role`), if the project has one."""
    path = SHIPPED_CONFIGS / model.lower() / role / "config.json"
    return read_config_json(path.parent) if path.is_file() else None


def pair_configs(model: str, drafter: str | None, shipped: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The config.json of --model and of its drafter (None: no drafter named), read before any weight is fetched,
    so that an unsupported or unavailable pair is refused before a download of tens of gigabytes. With `shipped`,
    an alias's config missing from the hub cache comes from SHIPPED_CONFIGS (a drafter none is shipped for: None)."""
    alias = ALIASES.get(model.lower())
    specs = (alias.target if alias else model, drafter or (alias.drafter if alias else None))
    configs: list[dict[str, Any] | None] = []
    missing: list[str] = []
    for spec, role in zip(specs, ("target", "drafter"), strict=True):
        if spec is None:
            configs.append(None)
        elif shipped and alias and spec == (alias.target if role == "target" else alias.drafter):
            configs.append(_hub_config(spec) or _shipped_config(model, role))
        elif Path(spec).expanduser().is_dir():
            configs.append(read_config_json(Path(spec).expanduser()))
        elif spec == EMBEDDED_TARGET:
            configs.append(read_config_json(embedded_target_dir()))
        elif looks_like_hub_id(spec):
            configs.append(_hub_config(spec))
            if configs[-1] is None:
                missing.append(spec)
        else:
            resolve_checkpoint(spec)  # raises the error that names what a --model may be
    if missing:
        named = " and ".join(s for s in specs if s)
        raise CheckpointError(
            f"{model!r} needs {named}; {', '.join(missing)} not in the local Hugging Face cache and HF_HUB_OFFLINE is set. "
            "On a machine with hub access run `hf download ORG/NAME --local-dir DIR` for each, copy them here, and "
            "build with --model TARGET_DIR --drafter DRAFTER_DIR"
        )
    target_config = configs[0]
    assert target_config is not None
    return target_config, configs[1]


def fetch_from_hub(repo_id: str) -> Path:
    """A hub checkpoint: from the local HF cache, else downloaded (only if this machine may reach the hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        if _hub_offline():
            raise CheckpointError(
                f"{repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: on a machine with hub "
                f"access run `hf download {repo_id} --local-dir DIR`, copy DIR here, and pass it as a path"
            ) from None
    print(f"[dflash-build] downloading {repo_id} from the Hugging Face hub ...", file=sys.stderr)
    return Path(snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES))


def resolve_checkpoint(spec: str) -> Path:
    """A local directory as given; the embedded target by name; a hub id through the cache or a download."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if spec == EMBEDDED_TARGET:
        return embedded_target_dir()
    if looks_like_hub_id(spec):
        return fetch_from_hub(spec)
    known = ", ".join([EMBEDDED_TARGET, *ALIASES])
    raise CheckpointError(f"{spec!r} is neither a directory, a known model ({known}), nor a hub id ORG/NAME")


def resolve_pair(model: str, drafter: str | None) -> tuple[Path, Path | None]:
    """(target dir, drafter dir or None) for --model/--drafter; an alias names both, and the embedded target
    comes with the shipped demo drafter."""
    alias = ALIASES.get(model.lower())
    target = resolve_checkpoint(alias.target if alias else model)
    if drafter is None and model == EMBEDDED_TARGET and (EMBEDDED_DRAFTER / "config.json").is_file():
        return target, EMBEDDED_DRAFTER
    drafter_spec = drafter or (alias.drafter if alias else None)
    return target, resolve_checkpoint(drafter_spec) if drafter_spec else None
