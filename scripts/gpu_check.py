"""GPU check of the dflash kernels (run by scripts/gpu_check.sh where a GPU is available; < 8 minutes on an H200).

1. Kernels vs the torch reference ops at Qwen3-8B DFlash drafter size (hidden 4096, 32/8 heads, head_dim 128,
   5 layers, B=16, block 16) for contexts of 1k, 8k and 32k: max error, median time (CUDA events) of kernel
   and reference, and achieved memory bandwidth against the GPU's peak (H200: ~4.3 TB/s usable of 4.8).
2. A torch target step at Qwen3-8B size (random bf16 weights): verifying 16 tokens vs one plain decode step.
3. The torch-cuda engine (the same graphs and runner `dflash-build --backend torch-cuda` serves): a small random
   qwen3 pair in float32 decoded greedily on the GPU and on the CPU (identical tokens?), then plain decoding and
   DFlash at Qwen3-8B target size in bf16 (random weights, so drafts are rarely accepted: the tok/s show the cost
   of a step, not DFlash's speed-up).

--smoke runs the same code at toy sizes on CPU (Triton interpreter) so CI keeps the script working.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run interpreted

import torch.nn.functional as F  # noqa: E402
from dflash_trt.builder.checkpoints import parse_target_config  # noqa: E402
from dflash_trt.builder.drafter_init import drafter_config_dict, init_drafter  # noqa: E402
from dflash_trt.builder.graphs import torch_engine  # noqa: E402
from dflash_trt.builder.networks import DrafterNetwork, TargetNetwork  # noqa: E402
from dflash_trt.plugins.block_denoise import block_denoise, block_denoise_triton  # noqa: E402
from dflash_trt.plugins.hidden_state_tap import TapWeights, hidden_state_tap, hidden_state_tap_triton  # noqa: E402
from dflash_trt.runtime.loop import generate, generate_plain  # noqa: E402

PEAK_BANDWIDTH = 4.3e12  # bytes/s, H200 achievable


@dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    batch: int
    block: int
    contexts: tuple[int, ...]
    target_layers: int
    target_intermediate: int
    vocab: int
    repeats: int


QWEN3_8B = Sizes(4096, 32, 8, 128, 5, 16, 16, (1024, 8192, 32768), 36, 12288, 151936, 20)
SMOKE = Sizes(64, 4, 2, 32, 2, 2, 16, (40,), 2, 128, 256, 2)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (compiles the kernel)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def check_block_denoise(sizes: Sizes, context: int, device: str, dtype: torch.dtype) -> dict[str, object]:
    b, s, h, hkv, d = sizes.batch, sizes.block, sizes.heads, sizes.kv_heads, sizes.head_dim
    q, block_k, block_v = (torch.randn(b, s, n, d, device=device, dtype=dtype) for n in (h, hkv, hkv))
    ctx_k, ctx_v = (torch.randn(b, context, hkv, d, device=device, dtype=dtype) for _ in range(2))
    ctx_len = torch.full((b,), context, device=device)
    positions = ctx_len[:, None] + torch.arange(s, device=device)
    args = (q, block_k, block_v, ctx_k, ctx_v, ctx_len, positions, False, None, 1 / math.sqrt(d))
    error = (block_denoise_triton(*args).float() - block_denoise(*args).float()).abs().max().item()
    kernel_s = median_seconds(lambda: block_denoise_triton(*args), sizes.repeats)
    reference_s = median_seconds(lambda: block_denoise(*args), sizes.repeats)
    moved = (ctx_k.numel() + ctx_v.numel() + q.numel() * 2 + block_k.numel() * 2) * ctx_k.element_size()
    return {"op": "BlockDenoise", "context": context, "max_abs_error": error, "kernel_ms": kernel_s * 1e3,
            "reference_ms": reference_s * 1e3, "kernel_bandwidth_fraction": moved / kernel_s / PEAK_BANDWIDTH}  # fmt: skip


def check_hidden_state_tap(sizes: Sizes, device: str, dtype: torch.dtype) -> dict[str, object]:
    e, hkv, d, layers = sizes.hidden, sizes.kv_heads, sizes.head_dim, sizes.layers
    rows = sizes.batch * sizes.block  # one step commits up to a block per sequence

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * 0.02).to(dtype)

    inv_freq = 1.0 / (1_000_000 ** (torch.arange(0, d, 2, device=device).float() / d))
    weights = TapWeights(w(e, 5 * e), 1 + w(e), [w(hkv * d, e) for _ in range(layers)], [None] * layers,
                         [w(hkv * d, e) for _ in range(layers)], [None] * layers, [1 + w(d) for _ in range(layers)],
                         inv_freq, 1.0, 1e-6)  # fmt: skip
    taps = torch.randn(sizes.batch, sizes.block, 5 * e, device=device, dtype=dtype)
    positions = torch.arange(sizes.block, device=device).expand(sizes.batch, -1) + 1000
    fused = F.linear(taps, weights.fc)
    identity = dataclasses.replace(weights, fc=torch.eye(e, device=device, dtype=dtype))  # reference from fused
    kernel_k, _ = hidden_state_tap_triton(fused, positions, weights)
    reference_k, _ = hidden_state_tap(fused, positions, identity)
    error = (kernel_k.float() - reference_k.float()).abs().max().item()
    kernel_s = median_seconds(lambda: hidden_state_tap_triton(fused, positions, weights), sizes.repeats)
    reference_s = median_seconds(lambda: hidden_state_tap(fused, positions, identity), sizes.repeats)
    moved = (2 * layers * hkv * d * e + rows * e + 2 * layers * rows * hkv * d) * fused.element_size()
    return {"op": "HiddenStateTap", "rows": rows, "max_abs_error": error, "kernel_ms": kernel_s * 1e3,
            "reference_ms": reference_s * 1e3, "kernel_bandwidth_fraction": moved / kernel_s / PEAK_BANDWIDTH}  # fmt: skip


@torch.no_grad()
def check_target_step(sizes: Sizes, device: str, dtype: torch.dtype, context: int = 1024) -> dict[str, object]:
    config = parse_target_config({
        "model_type": "qwen3", "vocab_size": sizes.vocab, "hidden_size": sizes.hidden,
        "intermediate_size": sizes.target_intermediate, "num_hidden_layers": sizes.target_layers,
        "num_attention_heads": sizes.heads, "num_key_value_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    })  # fmt: skip
    with torch.device(device):
        target = TargetNetwork(config).to(dtype).eval()
        cache = target.allocate_cache(1, context + sizes.block)
    past = cache.past(context)

    def run(tokens: int) -> None:
        ids = torch.randint(0, sizes.vocab, (1, tokens), device=device)
        positions = torch.arange(context, context + tokens, device=device)[None]
        target(ids, positions, past, logits_to_keep=tokens)

    verify_s = median_seconds(lambda: run(sizes.block), sizes.repeats)
    decode_s = median_seconds(lambda: run(1), sizes.repeats)
    # What the timed calls compute must agree: the block verified at once against the same tokens decoded one by
    # one, each writing its K/V rows for the next (the logits DFlash accepts drafts by, and plain decoding's).
    ids = torch.randint(0, sizes.vocab, (1, sizes.block), device=device)
    positions = torch.arange(context, context + sizes.block, device=device)[None]
    whole = target(ids, positions, past, logits_to_keep=sizes.block).logits.float()  # [1, S, V]
    one_by_one = []
    for i in range(sizes.block):
        out = target(ids[:, i : i + 1], positions[:, i : i + 1], cache.past(context + i), logits_to_keep=1)
        cache.write(positions[:, i : i + 1], out.k, out.v)
        one_by_one.append(out.logits.float())
    stepwise = torch.cat(one_by_one, dim=1)  # [1, S, V]
    return {"op": "target step", "context": context, "verify_16_ms": verify_s * 1e3, "decode_1_ms": decode_s * 1e3,
            "verify_over_decode": verify_s / decode_s,
            "verify_vs_decode_max_abs_logit_diff": (whole - stepwise).abs().max().item(),
            "verify_vs_decode_argmax_equal": bool(torch.equal(whole.argmax(-1), stepwise.argmax(-1)))}  # fmt: skip


def random_pair(sizes: Sizes, vocab: int, dtype: torch.dtype, seed: int) -> tuple[TargetNetwork, DrafterNetwork]:
    """A qwen3 target of `sizes` and a 1-layer drafter tapping 2 of its layers (1 below 4 layers), random weights."""
    config = parse_target_config({
        "model_type": "qwen3", "vocab_size": vocab, "hidden_size": sizes.hidden,
        "intermediate_size": sizes.target_intermediate, "num_hidden_layers": sizes.target_layers,
        "num_attention_heads": sizes.heads, "num_key_value_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    })  # fmt: skip
    taps = 2 if sizes.target_layers >= 4 else 1  # (z-lab's tap placement needs 4 layers for 2 taps)
    drafter = init_drafter(drafter_config_dict(config, num_layers=1, block_size=sizes.block, num_taps=taps), seed=seed)
    torch.manual_seed(seed)
    target = TargetNetwork(config, tuple(drafter.config.target_layer_ids))
    for parameter in target.parameters():  # decisive logits: greedy choices that rounding does not flip
        torch.nn.init.normal_(parameter, std=0.08)
    return target.to(dtype).eval(), drafter.to(dtype).eval()


@torch.no_grad()
def check_engine(sizes: Sizes, device: str, dtype: torch.dtype, max_tokens: int = 64) -> list[dict[str, object]]:
    prompt = list(range(3, 40))
    small = Sizes(256, 4, 2, 64, 1, 1, 16, (), 4, 512, 1024, 1)
    target, drafter = random_pair(small, small.vocab, torch.float32, seed=0)
    on_cpu = generate(torch_engine(target, drafter, 512), prompt, max_tokens).tokens
    on_device = generate(torch_engine(target, drafter, 512, device=device), prompt, max_tokens).tokens
    rows: list[dict[str, object]] = [{"op": "torch-cuda engine", "pair": "small random qwen3, float32",
                                      "device": device, "greedy_identical_to_cpu": on_device == on_cpu}]  # fmt: skip
    target, drafter = random_pair(sizes, sizes.vocab, dtype, seed=1)
    engine = torch_engine(target, drafter, 2048, device=device)
    for name, decode in (("plain", generate_plain), ("dflash", generate)):
        decode(engine, prompt, 8)  # warm-up
        began = time.perf_counter()
        out = decode(engine, prompt, max_tokens)
        seconds = time.perf_counter() - began
        rows.append({"op": "torch-cuda engine", "mode": name, "target_layers": sizes.target_layers,
                     "tok_s": len(out.tokens) / seconds, "tau": out.stats.tau})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes (runs on CPU through the Triton interpreter)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("gpu_check: no CUDA GPU is visible; run with --smoke for the CPU smoke run", file=sys.stderr)
        return 2
    sizes, dtype = (SMOKE if args.smoke else QWEN3_8B), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": args.dtype}))
    results = [check_block_denoise(sizes, context, device, dtype) for context in sizes.contexts]
    results.append(check_hidden_state_tap(sizes, device, dtype))
    results.append(check_target_step(sizes, device, dtype))
    results += check_engine(sizes, device, dtype)
    for row in results:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
