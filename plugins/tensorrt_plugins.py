"""TensorRT registration of the dflash ops with `tensorrt.plugin` (quickly-deployable plugins).

Per op: `register` (output shapes and dtypes from the input shape expressions), `autotune` (the dtype
combinations TensorRT may pick; BlockDenoise also offers context-chunk tactics), and `aot_impl`, which
compiles the op's Triton kernel to PTX for the GPU being built on, with its launch grid and runtime sizes as
symbolic expressions. The PTX is serialized into the engine, so engines run without Python.

No `from __future__ import annotations` here: tensorrt.plugin reads the annotations as objects.
"""

import torch
from dflash_trt.plugins import block_denoise, causal_conv1d, gated_delta_rule, hidden_state_tap
from dflash_trt.plugins.triton_launch import SUPPORTED_ARCHS, CompiledKernel, compile_for_gpu

_registered = False
FLOAT_IO = "FP32|FP16|BF16"  # every floating-point tensor of an op shares one dtype (inv_freq stays FP32)
NUM_WARPS = 4


def build_arch() -> int:
    """sm_XX of the GPU TensorRT builds on (TensorRT engines are built for the GPU they run on)."""
    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    if arch not in SUPPORTED_ARCHS:
        raise RuntimeError(f"the dflash kernels are compiled for sm_80 and sm_90; this GPU is sm_{arch}")
    return arch


def register_tensorrt_plugins() -> None:
    """Register dflash::HiddenStateTap, dflash::BlockDenoise, dflash::GatedDeltaRule and dflash::CausalConv1d in
    TensorRT's plugin registry (once)."""
    global _registered
    if _registered:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    _registered = True
    dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16}

    def aot_result(
        compiled: CompiledKernel, grid: tuple[trtp.SymInt32 | int, ...], *runtime_sizes: trtp.SymIntExpr
    ) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:
        """What an aot_impl returns: the kernel's PTX entry and text, a launch of `grid` programs (x, y[, z]) of the
        kernel's warps, and the kernel's runtime sizes as 32-bit scalars, in its argument order."""
        launch = trtp.KernelLaunchParams()
        launch.grid_x = grid[0]
        launch.grid_y = grid[1]
        if len(grid) > 2:
            launch.grid_z = grid[2]
        launch.block_x = compiled.num_warps * 32
        launch.shared_mem = compiled.shared_bytes
        scalars = trtp.SymIntExprs(len(runtime_sizes))
        for index, size in enumerate(runtime_sizes):
            scalars[index] = trtp.SymInt32(size)
        return compiled.name, compiled.ptx, launch, scalars

    @trtp.register("dflash::HiddenStateTap")
    def tap_shapes(
        fused: trtp.TensorDesc, positions: trtp.TensorDesc, hidden_norm: trtp.TensorDesc, k_proj: trtp.TensorDesc,
        v_proj: trtp.TensorDesc, k_norm: trtp.TensorDesc, inv_freq: trtp.TensorDesc, eps: float, rope_scaling: float,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:  # fmt: skip
        head_dim = k_norm.shape_expr[1]
        shape = (k_proj.shape_expr[0], fused.shape_expr[0], fused.shape_expr[1], k_proj.shape_expr[1] // head_dim, head_dim)
        return trtp.from_shape_expr(shape, fused.dtype), trtp.from_shape_expr(shape, fused.dtype)  # [L, B, T, Hkv, D]

    @trtp.autotune("dflash::HiddenStateTap")
    def tap_combinations(
        fused: trtp.TensorDesc, positions: trtp.TensorDesc, hidden_norm: trtp.TensorDesc, k_proj: trtp.TensorDesc,
        v_proj: trtp.TensorDesc, k_norm: trtp.TensorDesc, inv_freq: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc, ...],
    ) -> list[trtp.AutoTuneCombination]:  # fmt: skip
        io = ",".join([FLOAT_IO, "INT64", FLOAT_IO, FLOAT_IO, FLOAT_IO, FLOAT_IO, "FP32", FLOAT_IO, FLOAT_IO])
        return [trtp.AutoTuneCombination(io, "LINEAR")]

    @trtp.aot_impl("dflash::HiddenStateTap")
    def tap_kernel(
        fused: trtp.TensorDesc, positions: trtp.TensorDesc, hidden_norm: trtp.TensorDesc, k_proj: trtp.TensorDesc,
        v_proj: trtp.TensorDesc, k_norm: trtp.TensorDesc, inv_freq: trtp.TensorDesc, eps: float, rope_scaling: float,
        outputs: tuple[trtp.TensorDesc, ...], tactic: int,
    ) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        head_dim = k_norm.shape_expr[1].constant_value()
        layers, kv_heads = k_proj.shape_expr[0].constant_value(), k_proj.shape_expr[1].constant_value() // head_dim
        spec = hidden_state_tap.aot_spec(
            fused.shape_expr[2].constant_value(), kv_heads, head_dim, eps, rope_scaling, dtypes[fused.dtype]
        )
        compiled = compile_for_gpu(spec, build_arch(), NUM_WARPS)
        rows = fused.shape_expr[0] * fused.shape_expr[1]
        return aot_result(compiled, (trtp.cdiv(rows, hidden_state_tap.BLOCK_ROWS), layers * kv_heads), rows)

    @trtp.register("dflash::BlockDenoise")
    def denoise_shapes(
        q: trtp.TensorDesc, block_k: trtp.TensorDesc, block_v: trtp.TensorDesc, ctx_k: trtp.TensorDesc,
        ctx_v: trtp.TensorDesc, ctx_len: trtp.TensorDesc, block_positions: trtp.TensorDesc, causal: int, window: int,
        scale: float, max_block: int,
    ) -> trtp.TensorDesc:  # fmt: skip
        shape = (q.shape_expr[0], q.shape_expr[1], q.shape_expr[2] * q.shape_expr[3])
        return trtp.from_shape_expr(shape, q.dtype)  # [B, S, H*D]

    @trtp.autotune("dflash::BlockDenoise")
    def denoise_combinations(
        q: trtp.TensorDesc, block_k: trtp.TensorDesc, block_v: trtp.TensorDesc, ctx_k: trtp.TensorDesc,
        ctx_v: trtp.TensorDesc, ctx_len: trtp.TensorDesc, block_positions: trtp.TensorDesc,
        outputs: tuple[trtp.TensorDesc, ...],
    ) -> list[trtp.AutoTuneCombination]:  # fmt: skip
        io = ",".join([FLOAT_IO] * 5 + ["INT64", "INT64", FLOAT_IO])
        return [trtp.AutoTuneCombination(io, "LINEAR", list(block_denoise.TACTIC_BLOCK_N))]

    @trtp.aot_impl("dflash::BlockDenoise")
    def denoise_kernel(
        q: trtp.TensorDesc, block_k: trtp.TensorDesc, block_v: trtp.TensorDesc, ctx_k: trtp.TensorDesc,
        ctx_v: trtp.TensorDesc, ctx_len: trtp.TensorDesc, block_positions: trtp.TensorDesc, causal: int, window: int,
        scale: float, max_block: int, outputs: tuple[trtp.TensorDesc, ...], tactic: int,
    ) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        heads, head_dim = (q.shape_expr[i].constant_value() for i in (2, 3))
        spec = block_denoise.aot_spec(
            max_block, heads, block_k.shape_expr[2].constant_value(), head_dim, bool(causal), window or None,
            scale, dtypes[q.dtype], block_denoise.TACTIC_BLOCK_N.get(tactic, 32),
        )  # fmt: skip
        compiled = compile_for_gpu(spec, build_arch(), NUM_WARPS)
        return aot_result(compiled, (q.shape_expr[0], heads), ctx_k.shape_expr[1], q.shape_expr[1])  # T, S

    @trtp.register("dflash::GatedDeltaRule")
    def recurrence_shapes(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, g: trtp.TensorDesc, beta: trtp.TensorDesc,
        state: trtp.TensorDesc,
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:  # fmt: skip
        out = (q.shape_expr[0], q.shape_expr[1], q.shape_expr[2], v.shape_expr[3])  # [B, S, Hv, dv]
        return trtp.from_shape_expr(out, trt.float32), trtp.from_shape_expr(state.shape_expr, trt.float32)

    @trtp.autotune("dflash::GatedDeltaRule")
    def recurrence_combinations(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, g: trtp.TensorDesc, beta: trtp.TensorDesc,
        state: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc, ...],
    ) -> list[trtp.AutoTuneCombination]:  # fmt: skip
        return [trtp.AutoTuneCombination(",".join(["FP32"] * 8), "LINEAR")]  # the recurrence is fp32 end to end

    @trtp.aot_impl("dflash::GatedDeltaRule")
    def recurrence_kernel(
        q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, g: trtp.TensorDesc, beta: trtp.TensorDesc,
        state: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc, ...], tactic: int,
    ) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        heads, key_dim, value_dim = (q.shape_expr[2].constant_value(), q.shape_expr[3].constant_value(),
                                     v.shape_expr[3].constant_value())  # fmt: skip
        spec = gated_delta_rule.aot_spec(heads, key_dim, value_dim, torch.float32)
        compiled = compile_for_gpu(spec, build_arch(), NUM_WARPS)
        column_blocks = -(-value_dim // spec.constexprs["BLOCK_V"])
        return aot_result(compiled, (q.shape_expr[0], heads, column_blocks), q.shape_expr[1])  # runtime size: S

    @trtp.register("dflash::CausalConv1d")
    def conv_shapes(
        x: trtp.TensorDesc, window: trtp.TensorDesc, weight: trtp.TensorDesc, channels: int
    ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        extended = (x.shape_expr[0], window.shape_expr[1] + x.shape_expr[1], x.shape_expr[2])  # [B, K-1+S, C]
        return trtp.from_shape_expr(x.shape_expr, x.dtype), trtp.from_shape_expr(extended, x.dtype)

    @trtp.autotune("dflash::CausalConv1d")
    def conv_combinations(
        x: trtp.TensorDesc, window: trtp.TensorDesc, weight: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc, ...]
    ) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(",".join([FLOAT_IO] * 5), "LINEAR")]

    @trtp.aot_impl("dflash::CausalConv1d")
    def conv_kernel(
        x: trtp.TensorDesc, window: trtp.TensorDesc, weight: trtp.TensorDesc, channels: int,
        outputs: tuple[trtp.TensorDesc, ...], tactic: int,
    ) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:  # fmt: skip
        spec = causal_conv1d.aot_spec(channels, weight.shape_expr[2].constant_value(), dtypes[x.dtype])
        compiled = compile_for_gpu(spec, build_arch(), NUM_WARPS)
        channel_blocks = -(-channels // spec.constexprs["BLOCK_C"])
        return aot_result(compiled, (x.shape_expr[0], channel_blocks), x.shape_expr[1])  # runtime size: S
