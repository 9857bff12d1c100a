"""Ahead-of-time compilation report for the dflash kernels, without a GPU.

Each op's kernel is specialised on its attributes and model sizes (compile-time constants) and takes its
runtime sizes as 32-bit integers, in TensorRT's AOT plugin argument order (inputs, scalars, outputs), exactly
as the TensorRT plugins' `aot_impl` compiles it (plugins/tensorrt_plugins.py).

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
from dflash_trt.plugins import block_denoise, causal_conv1d, gated_delta_rule, hidden_state_tap
from dflash_trt.plugins.triton_launch import SUPPORTED_ARCHS, KernelSpec, compile_for_gpu

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DrafterShape:
    """The sizes a drafter's kernels are specialised on (defaults: a Qwen3-8B DFlash drafter)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    window: int = 0  # 0: full attention
    eps: float = 1e-6
    rope_scaling: float = 1.0
    # a hybrid target's Gated DeltaNet layers (defaults: Qwen3.5-27B), for dflash::GatedDeltaRule and CausalConv1d
    linear_heads: int = 48
    linear_key_heads: int = 16
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    conv_kernel: int = 4

    @property
    def conv_channels(self) -> int:
        """2 Hk dk + Hv dv: the convolved q, k and v of a Gated DeltaNet layer (10,240 at 27B)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_heads * self.linear_value_dim


def kernel_specs(shape: DrafterShape, dtype: torch.dtype) -> list[KernelSpec]:
    return [
        hidden_state_tap.aot_spec(shape.hidden, shape.kv_heads, shape.head_dim, shape.eps, shape.rope_scaling, dtype),
        block_denoise.aot_spec(
            shape.block_size, shape.heads, shape.kv_heads, shape.head_dim, False, shape.window or None,
            1 / math.sqrt(shape.head_dim), dtype,
        ),
        gated_delta_rule.aot_spec(shape.linear_heads, shape.linear_key_dim, shape.linear_value_dim, dtype),
        causal_conv1d.aot_spec(shape.conv_channels, shape.conv_kernel, dtype),
    ]  # fmt: skip


def report(shape: DrafterShape, archs: list[int]) -> list[dict[str, Any]]:
    rows = []
    for dtype in KERNEL_DTYPES:
        for spec in kernel_specs(shape, dtype):
            for arch in archs:
                compiled = asdict(compile_for_gpu(spec, arch))
                ptx = compiled.pop("ptx")
                rows.append({"kernel": spec.kernel.__name__, "dtype": str(dtype).removeprefix("torch."), "arch": arch,
                             "runtime_arguments": list(spec.signature), "grid": list(spec.grid), **compiled,
                             "ptx_bytes": len(ptx)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_trt.plugins.aot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, nargs="+", default=list(SUPPORTED_ARCHS), help="sm_XX numbers")
    defaults = DrafterShape()
    for field in ("hidden", "heads", "kv_heads", "head_dim", "block_size", "window"):
        parser.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = parser.parse_args(argv)
    shape = DrafterShape(args.hidden, args.heads, args.kv_heads, args.head_dim, args.block_size, args.window)
    try:
        rows = report(shape, args.arch)
    except (ValueError, RuntimeError) as error:
        print(f"dflash aot: error: {error}", file=sys.stderr)
        return 2
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{row['kernel']:<24} {row['dtype']:<9} sm_{row['arch']}  {len(row['parameters'])} params  "
                f"{row['registers']} regs  {row['spill_bytes']} B spilled  {row['shared_bytes']} B shared"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
