"""The dflash ops' Triton kernels, run by Triton's interpreter on CPU, against the torch reference semantics;
and their ahead-of-time compilation for sm_80/sm_90 (what the TensorRT AOT plugins embed).

Tolerances (max abs difference over outputs of magnitude ~1-5, the reference computed in fp32 from the same
rounded inputs): fp32 2e-5, fp16 4e-3, bf16 4e-2 -- one or two roundings of the output in that dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dflash_trt.plugins.block_denoise import block_denoise, block_denoise_triton
from dflash_trt.plugins.causal_conv1d import causal_conv1d, causal_conv1d_triton
from dflash_trt.plugins.gated_delta_rule import gated_delta_rule, gated_delta_rule_triton
from dflash_trt.plugins.hidden_state_tap import TapWeights, hidden_state_tap, hidden_state_tap_triton

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}
DTYPES = list(TOLERANCE)


def _max_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return (result.float() - reference.float()).abs().max().item()


def _tap_weights(hidden: int, n_taps: int, layers: int, kv_heads: int, head_dim: int, seed: int) -> TapWeights:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return TapWeights(
        normal(hidden, n_taps * hidden), 1 + normal(hidden), [normal(kv_heads * head_dim, hidden) for _ in range(layers)],
        [None] * layers, [normal(kv_heads * head_dim, hidden) for _ in range(layers)], [None] * layers,
        [1 + normal(head_dim) for _ in range(layers)], inv_freq, 1.0, 1e-6,
    )  # fmt: skip


def _cast(weights: TapWeights, dtype: torch.dtype) -> TapWeights:
    def c(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to(dtype) for t in tensors]

    return TapWeights(
        weights.fc.to(dtype), weights.hidden_norm.to(dtype), c(weights.k_proj), weights.k_bias, c(weights.v_proj),
        weights.v_bias, c(weights.k_norm), weights.inv_freq, weights.rope_scaling, weights.eps,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("batch", "slots", "hidden", "layers", "kv_heads", "head_dim"),
    [(1, 1, 64, 1, 1, 32), (2, 21, 96, 2, 2, 32), (3, 7, 80, 2, 1, 64)],  # rows and hidden not multiples of the tiles
)
def test_hidden_state_tap_kernel_matches_reference(
    dtype: torch.dtype, batch: int, slots: int, hidden: int, layers: int, kv_heads: int, head_dim: int
) -> None:
    weights = _cast(_tap_weights(hidden, 3, layers, kv_heads, head_dim, seed=slots), dtype)
    generator = torch.Generator().manual_seed(batch)
    taps = torch.randn(batch, slots, 3 * hidden, generator=generator).to(dtype)
    starts = torch.randint(0, 500, (batch, 1), generator=generator)
    positions = starts + torch.arange(slots)  # every sequence at its own positions

    ctx_k, ctx_v = hidden_state_tap_triton(F.linear(taps, weights.fc), positions, weights)
    fp32 = _cast(weights, torch.float32)
    ref_k, ref_v = hidden_state_tap(taps.float(), positions, fp32)
    if dtype != torch.float32:  # the kernel starts from fused = fc(taps) in its dtype: so does the reference
        ref_k, ref_v = hidden_state_tap_from_fused(F.linear(taps, weights.fc).float(), positions, fp32)
    assert ctx_k.shape == ref_k.shape == (layers, batch, slots, kv_heads, head_dim) and ctx_k.dtype == dtype
    assert _max_error(ctx_k, ref_k) <= TOLERANCE[dtype] * max(1.0, ref_k.abs().max().item())
    assert _max_error(ctx_v, ref_v) <= TOLERANCE[dtype] * max(1.0, ref_v.abs().max().item())


def hidden_state_tap_from_fused(
    fused: torch.Tensor, positions: torch.Tensor, weights: TapWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference with fc already applied (an identity fc over the fused features)."""
    return hidden_state_tap(fused, positions, dataclasses.replace(weights, fc=torch.eye(fused.shape[-1])))


BLOCK_CASES = {
    # name: (batch, heads, kv_heads, head_dim, block size, ctx slots, causal, window)
    "bidirectional-b16": (2, 4, 2, 32, 16, 37, False, None),
    "bidirectional-b8": (3, 2, 1, 16, 8, 50, False, None),
    "first-3-slots": (2, 4, 2, 32, 3, 29, False, None),  # a step that uses 2 drafts denoises 3 slots
    "context-length-0": (2, 4, 2, 32, 16, 0, False, None),
    "sliding-causal": (2, 4, 2, 32, 16, 70, True, 5),
    "sliding-bidirectional": (2, 4, 4, 32, 8, 45, False, 6),
    "window-covers-all": (2, 4, 2, 32, 16, 40, True, 4096),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_block_denoise_kernel_matches_reference(dtype: torch.dtype, case: str) -> None:
    batch, heads, kv_heads, head_dim, size, slots, causal, window = BLOCK_CASES[case]
    generator = torch.Generator().manual_seed(len(case))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q, block_k, block_v = (
        randn(batch, size, heads, head_dim),
        randn(batch, size, kv_heads, head_dim),
        randn(batch, size, kv_heads, head_dim),
    )
    ctx_k, ctx_v = randn(batch, slots, kv_heads, head_dim), randn(batch, slots, kv_heads, head_dim)
    ctx_len = torch.randint(0, slots + 1, (batch,), generator=generator)  # a different committed length per sequence
    ctx_len[0] = slots
    rows = torch.arange(slots)[None, :, None, None] >= ctx_len[:, None, None, None]
    ctx_k, ctx_v = ctx_k.masked_fill(rows, 1e4), ctx_v.masked_fill(rows, 1e4)  # stale rows: must never count
    positions = ctx_len[:, None] + torch.arange(size)
    scale = 1 / math.sqrt(head_dim)

    result = block_denoise_triton(q, block_k, block_v, ctx_k, ctx_v, ctx_len, positions, causal, window, scale)
    reference = block_denoise(
        q.float(), block_k.float(), block_v.float(), ctx_k.float(), ctx_v.float(), ctx_len, positions, causal, window, scale
    )
    assert result.shape == reference.shape == (batch, size, heads * head_dim) and result.dtype == dtype
    assert _max_error(result, reference) <= TOLERANCE[dtype] * max(1.0, reference.abs().max().item())


def test_kernels_refuse_cpu_tensors_without_the_interpreter() -> None:
    code = (
        "import torch\n"
        "from dflash_trt.plugins.block_denoise import block_denoise_triton\n"
        "x = torch.zeros(1, 16, 2, 16)\n"
        "block_denoise_triton(x, x, x, x, x, torch.tensor([16]), torch.arange(16, 32)[None], False, None, 0.25)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "set TRITON_INTERPRET=1 before triton is imported, or pass CUDA tensors" in result.stderr


def test_kernels_compile_ahead_of_time_for_sm80_and_sm90() -> None:
    """Every kernel x dtype compiles to PTX for both architectures in a process without the interpreter: the
    entry is the kernel, its parameters are inputs, scalars, outputs in TensorRT's AOT order, nothing spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "dflash_trt.plugins.aot", "--arch", "80", "90", "--json"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    kernels = ("hidden_state_tap_kernel", "block_denoise_kernel", "gated_delta_rule_kernel", "causal_conv1d_kernel")
    dtypes = ("float32", "float16", "bfloat16")
    assert {(r["kernel"], r["dtype"], r["arch"]) for r in rows} == {(k, d, a) for k in kernels for d in dtypes for a in (80, 90)}
    for row in rows:
        assert row["name"] == row["kernel"]
        declared = row["runtime_arguments"]
        # Triton appends its scratch pointers (unused by these kernels) after the declared arguments
        assert row["parameters"][: len(declared)] == [f"{row['kernel']}_param_{i}" for i in range(len(declared))]
        assert len(row["parameters"]) - len(declared) in (0, 1, 2)
        assert row["spill_bytes"] == 0, row
        assert 0 < row["registers"] <= 255
        assert row["shared_bytes"] <= 48 * 1024  # launchable without a per-function opt-in


def test_gpu_check_script_runs_at_smoke_size() -> None:
    """scripts/gpu_check.py (the GPU table) at toy sizes on CPU: every row present, kernels agree in bf16."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    engine_rows = ["torch-cuda engine"] * 5  # plain and DFlash at batch 1, then with 8 clients, then their agreement
    assert [r.get("op") for r in rows[1:]] == ["BlockDenoise", "HiddenStateTap", "target step", *engine_rows]
    for row in rows[1:3]:
        assert row["max_abs_error"] <= TOLERANCE[torch.bfloat16] * 2
    # the 16-token verify and 16 one-token decode steps compute the same logits (float32 on the CPU here)
    assert rows[3]["verify_vs_decode_max_abs_logit_diff"] < 1e-3 and rows[3]["verify_vs_decode_argmax_equal"] is True
    assert [(r["mode"], r.get("batch"), r.get("clients")) for r in rows[4:8]] == [
        ("plain", 1, None), ("dflash", 1, None), ("dflash", None, 8), ("plain", None, 8)
    ]  # fmt: skip
    assert all(r["tok_s"] > 0 for r in rows[4:8]) and all(r["consistent"] for r in rows[6:8])
    # the engine path on its own device (the CPU here): DFlash one at a time gives plain decoding's every token
    assert rows[5]["tokens_equal_to_plain_before_first_difference"] == rows[5]["tokens"]
    assert rows[8]["batched_outputs_equal"] is True  # DFlash batched gives plain decoding's tokens


GDN_CASES = {
    # name: (batch, tokens, value heads, key dim, value dim)
    "block-16": (2, 16, 4, 32, 32),
    "one-token": (3, 1, 2, 16, 16),
    "prompt-odd-dims": (1, 23, 2, 24, 40),  # dims not powers of two, several value-column blocks
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(GDN_CASES))
def test_gated_delta_rule_kernel_matches_reference(dtype: torch.dtype, case: str) -> None:
    """The recurrence in fp32 either way: bf16 q/k/v are upcast on load, as the reference gets the same rounded
    values in fp32; after up to 23 rank-1 updates the tolerance is that of fp32 (2e-5, relative to ~1)."""
    batch, tokens, heads, key_dim, value_dim = GDN_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    k = F.normalize(torch.randn(batch, tokens, heads, key_dim, generator=generator), dim=-1).to(dtype)
    q = (F.normalize(torch.randn(batch, tokens, heads, key_dim, generator=generator), dim=-1) / key_dim**0.5).to(dtype)
    v = torch.randn(batch, tokens, heads, value_dim, generator=generator).to(dtype)
    g = -torch.rand(batch, tokens, heads, generator=generator)
    beta = torch.rand(batch, tokens, heads, generator=generator)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator)

    out, final = gated_delta_rule_triton(q, k, v, g, beta, state)
    ref_out, ref_final = gated_delta_rule(q.float(), k.float(), v.float(), g, beta, state)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape and out.dtype == torch.float32
    assert _max_error(out, ref_out) <= 2e-5 * max(1.0, ref_out.abs().max().item())
    assert _max_error(final, ref_final) <= 2e-5 * max(1.0, ref_final.abs().max().item())


CONV_CASES = {
    # name: (batch, tokens, channels, kernel)
    "block-16": (2, 16, 96, 4),
    "one-token": (3, 1, 40, 4),
    "prompt-odd-channels": (1, 23, 200, 4),  # channels not a power of two, two channel blocks
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_causal_conv1d_kernel_matches_reference(dtype: torch.dtype, case: str) -> None:
    """Depthwise causal convolution + SiLU over [window ; block] in fp32 from the same rounded inputs, one rounding
    of the output; `extended` is a copy, so it is exact."""
    batch, tokens, channels, kernel = CONV_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    x = torch.randn(batch, tokens, channels, generator=generator).to(dtype)
    window = torch.randn(batch, kernel - 1, channels, generator=generator).to(dtype)
    weight = (torch.randn(channels, 1, kernel, generator=generator) * 0.5).to(dtype)
    y, extended = causal_conv1d_triton(x, window, weight)
    ref_y, ref_extended = causal_conv1d(x.float(), window.float(), weight.float())
    assert y.dtype == dtype and y.shape == ref_y.shape and torch.equal(extended.float(), ref_extended)
    assert _max_error(y, ref_y) <= TOLERANCE[dtype] * max(1.0, ref_y.abs().max().item())


def test_gpu_carry_wheels_install_without_their_tests_and_the_server_finds_its_libraries(tmp_path: Path) -> None:
    """scripts/gpu_carry.py: a wheel rewritten uncompressed without its tests still installs with pip (its RECORD
    lists what is left) and imports; the bundled tritonserver's libraries are found through their NEEDED entries."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import gpu_carry
    finally:
        sys.path.pop(0)
    import zipfile

    wheel = tmp_path / "tiny_pkg-1.0-py3-none-any.whl"
    files = {"tiny_pkg/__init__.py": "VALUE = 7\n", "tiny_pkg/tests/test_it.py": "x = 1\n"}
    record = "".join(f"{name},,\n" for name in [*files, "tiny_pkg-1.0.dist-info/METADATA", "tiny_pkg-1.0.dist-info/WHEEL"])
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr("tiny_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n")
        archive.writestr("tiny_pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("tiny_pkg-1.0.dist-info/RECORD", record + "tiny_pkg-1.0.dist-info/RECORD,,\n")
    (tmp_path / "stored").mkdir()
    gpu_carry.stored_wheel(wheel, tmp_path / "stored")
    with zipfile.ZipFile(tmp_path / "stored" / wheel.name) as stored:
        assert {i.compress_type for i in stored.infolist()} == {zipfile.ZIP_STORED}
        assert "tiny_pkg/tests/test_it.py" not in stored.namelist()
        assert b"tests" not in stored.read("tiny_pkg-1.0.dist-info/RECORD")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(tmp_path / "site")]
    subprocess.run([*install, str(tmp_path / "stored" / wheel.name)], check=True, capture_output=True)
    assert not (tmp_path / "site" / "tiny_pkg" / "tests").exists()
    program = "import tiny_pkg; print(tiny_pkg.VALUE)"
    imported = subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                              capture_output=True, text=True, check=True)  # fmt: skip
    assert imported.stdout.strip() == "7"

    pytriton = pytest.importorskip("pytriton")
    site = Path(pytriton.__file__).resolve().parent.parent
    server = site / "pytriton" / "tritonserver" / "bin" / "tritonserver"
    libraries = {p.name for p in gpu_carry.needed_libraries([server], site / "nvidia_pytriton.libs")}
    assert any(name.startswith("libtritonserver") for name in libraries)  # direct
    assert any(name.startswith("libcrypto") for name in libraries)  # direct, and through libssl
    assert not any(name.startswith("libpython3") for name in libraries)  # the stubs' business, not the server's
