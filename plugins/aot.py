"""Ahead-of-time compilation of the dflash kernels for NVIDIA GPUs, without a GPU.

Each op's kernel is specialised on its attributes and model sizes (compile-time constants) and takes its
runtime sizes as 32-bit integers, in TensorRT's AOT plugin argument order: inputs, scalars, outputs. The
same specs serve the TensorRT plugins' `aot_impl` and the report below.

    python -m dflash_trt.plugins.aot --arch 80 90 [--hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 ...]

prints, per kernel, dtype and architecture: the PTX entry, its parameters, registers and spills (ptxas -v).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from dflash_trt.plugins import block_denoise, hidden_state_tap
from dflash_trt.plugins.triton_launch import SUPPORTED_ARCHS, CompiledKernel, compile_for_gpu, triton_type

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DrafterShape:
    """The sizes a drafter's kernels are specialised on (defaults: a Qwen3-8B DFlash drafter)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 5
    block_size: int = 16
    window: int = 0  # 0: full attention
    eps: float = 1e-6
    rope_scaling: float = 1.0


@dataclass(frozen=True)
class KernelSpec:
    kernel: Any  # triton.JITFunction
    signature: dict[str, str]  # runtime arguments -> Triton types, in order
    constexprs: dict[str, Any]


def hidden_state_tap_spec(shape: DrafterShape, dtype: torch.dtype) -> KernelSpec:
    element = "*" + triton_type(dtype)
    signature = {
        "fused": element, "positions": "*i64", "hidden_norm": element, "k_proj": element, "v_proj": element,
        "k_norm": element, "inv_freq": "*fp32", "rows": "i32", "ctx_k": element, "ctx_v": element,
    }  # fmt: skip
    constexprs = {
        "HIDDEN": shape.hidden, "KV_HEADS": shape.kv_heads, "HEAD_DIM": shape.head_dim, "EPS": shape.eps,
        "ROPE_SCALING": shape.rope_scaling, "BLOCK_T": hidden_state_tap.BLOCK_ROWS, "BLOCK_E": hidden_state_tap.BLOCK_E,
        "UPCAST": False,
    }  # fmt: skip
    return KernelSpec(hidden_state_tap.hidden_state_tap_kernel, signature, constexprs)


def block_denoise_spec(shape: DrafterShape, dtype: torch.dtype, causal: bool = False, block_n: int = 32) -> KernelSpec:
    element = "*" + triton_type(dtype)
    signature = {
        "q": element, "block_k": element, "block_v": element, "ctx_k": element, "ctx_v": element, "ctx_len": "*i64",
        "block_positions": "*i64", "ctx_slots": "i32", "out": element,
    }  # fmt: skip
    constexprs = block_denoise.kernel_constexprs(
        shape.block_size, shape.heads, shape.kv_heads, shape.head_dim, causal, shape.window or None,
        1 / math.sqrt(shape.head_dim), False, block_n,
    )  # fmt: skip
    return KernelSpec(block_denoise.block_denoise_kernel, signature, constexprs)


def compile_spec(spec: KernelSpec, arch: int) -> CompiledKernel:
    return compile_for_gpu(spec.kernel, spec.signature, spec.constexprs, arch)


def report(shape: DrafterShape, archs: list[int]) -> list[dict[str, Any]]:
    rows = []
    for dtype in KERNEL_DTYPES:
        for spec in (hidden_state_tap_spec(shape, dtype), block_denoise_spec(shape, dtype)):
            for arch in archs:
                compiled = compile_spec(spec, arch)
                entry = asdict(compiled)
                del entry["ptx"]
                rows.append({"kernel": spec.kernel.__name__, "dtype": str(dtype).removeprefix("torch."), "arch": arch,
                             "runtime_arguments": list(spec.signature), **entry, "ptx_bytes": len(compiled.ptx)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_trt.plugins.aot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--arch", type=int, nargs="+", default=list(SUPPORTED_ARCHS), help="sm_XX numbers")
    defaults = DrafterShape()
    for field in ("hidden", "heads", "kv_heads", "head_dim", "layers", "block_size", "window"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = parser.parse_args(argv)
    shape = DrafterShape(args.hidden, args.heads, args.kv_heads, args.head_dim, args.layers, args.block_size, args.window)
    try:
        rows = report(shape, args.arch)
    except (ValueError, RuntimeError) as error:
        print(f"dflash aot: error: {error}", file=sys.stderr)
        return 2
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['kernel']:<24} {row['dtype']:<9} sm_{row['arch']}  {len(row['parameters'])} params  "
                  f"{row['registers']} regs  {row['spill_bytes']} B spilled  {row['shared_bytes']} B shared")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
