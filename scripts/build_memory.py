"""Peak resident memory of `dflash-build`, against the bytes of the checkpoint it builds from.

Writes (once, into --workdir) a random `qwen3_5` checkpoint as published (the vision-language wrapper, a tiny vision
tower, bf16 text weights under model.language_model.*; 28 layers; hidden 1024: about 0.63 B parameters, hidden
2048: about 1.9 B) with the demo target's tokenizer, then runs `dflash-build` on it, or on the demo target
(`--model smollm2-135m`), in a child process and reads the child's peak RSS (getrusage). One JSON line per build:

    python scripts/build_memory.py --workdir /tmp/build-memory                     # the 0.63 B qwen3_5, bf16 engine
    python scripts/build_memory.py --workdir /tmp/build-memory --hidden-size 2048  # 1.9 B
    python scripts/build_memory.py --workdir /tmp/build-memory --dtype float32     # an fp32 CPU engine
    python scripts/build_memory.py --workdir /tmp/build-memory --model smollm2-135m --dtype float32
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from dflash_trt.builder.models import resolve_checkpoint
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

TEXT_CONFIG = dict(
    vocab_size=49152,  # the demo tokenizer's
    num_hidden_layers=28,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    eos_token_id=2,
    pad_token_id=2,
)  # fmt: skip
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=1, num_position_embeddings=16)


def write_qwen35_checkpoint(directory: Path, hidden_size: int) -> Path:
    """The random bf16 checkpoint (skipped when it exists) with the demo target's tokenizer files."""
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    text = {**TEXT_CONFIG, "hidden_size": hidden_size, "intermediate_size": hidden_size * 7 // 2}
    vision = {**TINY_VISION, "out_hidden_size": hidden_size}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    demo = resolve_checkpoint("smollm2-135m")
    for path in demo.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, directory / path.name)
    return directory


def checkpoint_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def measure(model: str, source: Path, output: Path, extra: list[str]) -> dict[str, object]:
    command = [sys.executable, "-m", "dflash_trt.builder.cli", "--model", model, "--output", str(output), "--force", *extra]
    began = time.perf_counter()
    subprocess.run(command, check=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    engine = output / "dflash" / "1"
    weights = sum(p.stat().st_size for p in engine.rglob("weights.bin"))
    read = checkpoint_bytes(source)
    return {
        "model": model, "options": extra, "checkpoint_bytes": read, "engine_weight_bytes": weights,
        "peak_rss_bytes": peak, "peak_over_checkpoint": round(peak / read, 2),
        "peak_over_engine_weights": round(peak / weights, 2) if weights else None,
        "seconds": round(time.perf_counter() - began, 1)
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--model", default="qwen3_5-random", help="qwen3_5-random (written here) or smollm2-135m")
    parser.add_argument("--hidden-size", type=int, default=1024, help="of the random qwen3_5 checkpoint")
    parser.add_argument("--dtype", default="bfloat16", help="dflash-build --dtype")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model == "qwen3_5-random":
        source = write_qwen35_checkpoint(args.workdir / f"qwen3_5-random-{args.hidden_size}", args.hidden_size)
        model = str(source)
    else:
        source, model = resolve_checkpoint(args.model), args.model
    extra = ["--dtype", args.dtype, "--max-seq-len", "256", "--max-batch-size", "2"]
    print(json.dumps(measure(model, source, args.workdir / "repo", extra)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
