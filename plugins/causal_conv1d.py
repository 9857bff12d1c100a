"""dflash::CausalConv1d — the depthwise causal convolution of Gated DeltaNet layers, with its SiLU, over a block that
continues a window of the layer's earlier inputs.

    extended = [window ; x]                                                  [B, K-1+S, C]
    y[b, t, c] = silu(sum_j weight[c, 0, j] * extended[b, t + j, c])         t = 0 .. S-1

returns (y [B, S, C], extended). The op returns the window with the block appended rather than the next window:
which K-1 rows become the window is known only after verification (`gated_deltanet.commit_window` slices
`extended` at the accepted length), so the same op serves prefill, verify and decode. The reference is
transformers' `torch_causal_conv1d_update` (F.conv1d over [state ; input], then SiLU); TensorRT-Edge-LLM's
`causal_conv1d` plugin takes the same (input, conv state, weight). The Triton kernel (a program per sequence and
block of channels: channels are independent) is what the TensorRT plugin compiles ahead of time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from dflash_trt.plugins.onnx_domain import DFLASH, DOMAIN, DOMAIN_VERSION, op
from dflash_trt.plugins.triton_launch import KernelSpec, element_pointer, launch
from onnxscript import script

BLOCK_C = 128  # channels per program


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, C]; window [B, K-1, C] (same dtype); weight [C, 1, K] -> (y [B, S, C], extended [B, K-1+S, C])."""
    channels = weight.shape[0]
    if torch.compiler.is_exporting():
        y, extended = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::CausalConv1d",
            (x, window, weight),
            {"channels": int(channels)},
            dtypes=(x.dtype, x.dtype),
            shapes=(tuple(x.shape), (x.shape[0], window.shape[1] + x.shape[1], x.shape[2])),
            version=DOMAIN_VERSION,
        )
        return y, extended
    extended = torch.cat([window, x], dim=1)
    conv = F.conv1d(extended.transpose(1, 2), weight, groups=channels)  # [B, C, S]
    return F.silu(conv).transpose(1, 2), extended


@script(DFLASH, default_opset=op)
def CausalConv1d(x, window, weight, channels: int):
    """ONNX body of dflash::CausalConv1d (same shapes as `causal_conv1d`)."""
    extended = op.Concat(window, x, axis=1)  # [B, K-1+S, C]
    conv = op.Conv(op.Transpose(extended, perm=[0, 2, 1]), weight, group=channels)  # [B, C, S]
    y = op.Transpose(op.Mul(conv, op.Sigmoid(conv)), perm=[0, 2, 1])
    return y, extended


ONNX_FUNCTIONS = (CausalConv1d,)


@triton.jit
def causal_conv1d_kernel(
    x, window, weight,  # inputs (TensorRT AOT order): x [B, S, C]; window [B, K-1, C]; weight [C, 1, K]
    length,  # S, the only runtime size besides the grid
    y, extended,  # outputs: [B, S, C], [B, K-1+S, C]
    CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, channels c0..c0+BLOCK_C): copy [window ; x] to `extended` and convolve, in fp32, from the
    inputs themselves (no read of what this program wrote)."""
    b, channel_block = tl.program_id(0), tl.program_id(1)
    offs_c = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs_c < CHANNELS
    for t in range(0, KERNEL - 1):
        row = tl.load(window + (b * (KERNEL - 1) + t) * CHANNELS + offs_c, mask=ok)
        tl.store(extended + (b * (KERNEL - 1 + length) + t) * CHANNELS + offs_c, row, mask=ok)
    for t in range(0, length):
        row = tl.load(x + (b * length + t) * CHANNELS + offs_c, mask=ok)
        tl.store(extended + (b * (KERNEL - 1 + length) + KERNEL - 1 + t) * CHANNELS + offs_c, row, mask=ok)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            source = t + j  # row of [window ; x]
            if source < KERNEL - 1:
                row_in = tl.load(window + (b * (KERNEL - 1) + source) * CHANNELS + offs_c, mask=ok, other=0.0)
            else:
                row_in = tl.load(x + (b * length + source - (KERNEL - 1)) * CHANNELS + offs_c, mask=ok, other=0.0)
            tap = tl.load(weight + offs_c * KERNEL + j, mask=ok, other=0.0).to(tl.float32)
            acc += tap * row_in.to(tl.float32)
        out = acc * tl.sigmoid(acc)
        tl.store(y + (b * length + t) * CHANNELS + offs_c, out.to(y.dtype.element_ty), mask=ok)


def kernel_constexprs(channels: int, kernel: int) -> dict[str, int]:
    return {"CHANNELS": channels, "KERNEL": kernel, "BLOCK_C": min(BLOCK_C, triton.next_power_of_2(channels))}


def aot_spec(channels: int, kernel: int, dtype: torch.dtype) -> KernelSpec:
    """The kernel for a GPU build: grid (batch, channel blocks); every tensor in `dtype`."""
    element = element_pointer(dtype)
    signature = {"x": element, "window": element, "weight": element, "length": "i32", "y": element, "extended": element}
    return KernelSpec(causal_conv1d_kernel, signature, kernel_constexprs(channels, kernel), ("batch", "channel_blocks"))


def causal_conv1d_triton(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op through its Triton kernel; same arguments and results as `causal_conv1d`."""
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    constexprs = kernel_constexprs(channels, kernel)
    y = torch.empty_like(x)
    extended = torch.empty((batch, kernel - 1 + length, channels), dtype=x.dtype, device=x.device)
    grid = (batch, triton.cdiv(channels, constexprs["BLOCK_C"]))
    launch(
        causal_conv1d_kernel, grid, x.contiguous(), window.contiguous(), weight.contiguous(), length, y, extended, **constexprs
    )
    return y, extended
