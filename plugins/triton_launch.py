"""Running and compiling the dflash Triton kernels: on a GPU they run compiled; CPU tensors run in Triton's
interpreter (the same kernel source, executed by numpy), which is how CI checks them against the reference.
The interpreter is chosen when triton is imported (TRITON_INTERPRET=1), so one process either interprets or
compiles: the tests interpret, `python -m dflash_trt.plugins.aot` compiles.

`compile_for_gpu` compiles a kernel ahead of time for an NVIDIA architecture without a GPU present (PTX plus
the ptxas register report), which is what the TensorRT AOT plugins embed in an engine.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

TORCH_TO_TRITON = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32"}
SUPPORTED_ARCHS = (80, 90)  # sm_80 (A100) and sm_90 (H100/H200)
DEFAULT_SHARED_LIMIT = 48 * 1024  # bytes a kernel may use without opting in per function (an AOT launch cannot)


def upcast_dots(tensor: torch.Tensor) -> bool:
    """Whether the kernel does its dots as IEEE fp32: in the interpreter (its bf16/fp16 `tl.dot` is wrong).
    On a GPU, dots use tensor cores with fp32 accumulation: fp16/bf16 natively, fp32 inputs as TF32."""
    return not tensor.is_cuda


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def launch(kernel: triton.JITFunction, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    """kernel[grid](*args, **constexprs): compiled on CUDA tensors, interpreted on CPU tensors."""
    on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    if not on_gpu and not interpreting():
        raise RuntimeError(
            f"{kernel.__name__} got CPU tensors: Triton kernels run on CPU only in its interpreter; "
            "set TRITON_INTERPRET=1 before triton is imported, or pass CUDA tensors"
        )
    kernel[grid](*args, **constexprs)


@dataclass(frozen=True)
class KernelSpec:
    """A kernel specialised for AOT compilation: runtime arguments in TensorRT's order (inputs, 32-bit integer
    scalars, outputs) with their Triton types, and the compile-time constants."""

    kernel: triton.JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    grid: tuple[str, ...]  # what each grid axis spans, for reports


@dataclass(frozen=True)
class CompiledKernel:
    name: str  # the PTX entry point
    ptx: str
    num_warps: int
    num_stages: int  # software-pipelining depth: the deepest whose shared memory fits DEFAULT_SHARED_LIMIT
    shared_bytes: int
    parameters: tuple[str, ...]  # the entry's .param names, in order
    registers: int  # from ptxas -v
    spill_bytes: int  # spill stores + loads, from ptxas -v


def compile_for_gpu(spec: KernelSpec, arch: int, num_warps: int = 4) -> CompiledKernel:
    """Compile for sm_<arch> without a GPU (PTX, then ptxas for the register report)."""
    kernel, signature, constexprs = spec.kernel, spec.signature, spec.constexprs
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch={arch} is not supported: compile for one of {SUPPORTED_ARCHS} (sm_80, sm_90)")
    if interpreting():
        raise RuntimeError("cannot compile kernels while TRITON_INTERPRET=1 is set; compile in a process without it")
    source = ASTSource(kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    for num_stages in (3, 2, 1):
        options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        if compiled.metadata.shared <= DEFAULT_SHARED_LIMIT:
            break
    else:
        raise RuntimeError(f"{kernel.__name__} needs {compiled.metadata.shared} B of shared memory even unpipelined")
    ptx = compiled.asm["ptx"]
    name = compiled.metadata.name
    registers, spills = ptxas_report(ptx, name, arch)
    return CompiledKernel(
        name, ptx, compiled.metadata.num_warps, num_stages, compiled.metadata.shared, entry_parameters(ptx, name), registers,
        spills,
    )  # fmt: skip


def entry_parameters(ptx: str, name: str) -> tuple[str, ...]:
    """The .param names of PTX entry `name`, in order."""
    match = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError(f"PTX has no .entry {name}")
    return tuple(re.findall(r"\.param\s+\.\S+\s+(?:\.ptr\s+\.global\s+)?(?:\.align\s+\d+\s+)?(\w+)", match.group(1)))


def ptxas_report(ptx: str, name: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) of entry `name` from Triton's bundled ptxas -v."""
    ptxas = get_ptxas(arch).path  # the ptxas Triton itself assembles this arch with
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    gpu_name = target.group(1) if target else f"sm_{arch}"  # sm_90 kernels may target sm_90a
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / f"{name}.ptx"
        source.write_text(ptx)
        result = subprocess.run(
            [ptxas, f"--gpu-name={gpu_name}", "-v", "-o", str(source.with_suffix(".cubin")), str(source)],
            capture_output=True, text=True,
        )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed on {name} for {gpu_name}:\n{result.stderr}")
    report = result.stderr
    registers = re.search(rf"Function properties for {re.escape(name)}.*?Used (\d+) registers", report, re.S)
    spill_line = r"\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    spills = re.search(rf"Function properties for {re.escape(name)}{spill_line}", report)
    if registers is None or spills is None:
        raise ValueError(f"unexpected ptxas report for {name}:\n{report}")
    return int(registers.group(1)), int(spills.group(2)) + int(spills.group(3))


def triton_type(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_TRITON[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no dflash kernel; use float32, float16 or bfloat16") from None


def element_pointer(dtype: torch.dtype) -> str:
    return "*" + triton_type(dtype)
