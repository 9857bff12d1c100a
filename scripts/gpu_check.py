"""GPU check of the dflash kernels, the torch-cuda engine and its serving (run by scripts/gpu_check.sh where a GPU
is available; < 8 minutes on an H200). Prints one JSON line per measurement.

1. Kernels vs the torch reference ops at Qwen3-8B DFlash drafter size (hidden 4096, 32/8 heads, head_dim 128,
   5 layers, B=16, block 16) for contexts of 1k, 8k and 32k: max error, median time (CUDA events) of kernel
   and reference, and achieved memory bandwidth against the GPU's peak (H200: ~4.3 TB/s usable of 4.8).
2. A torch target step at Qwen3-8B size (random bf16 weights): verifying 16 tokens vs one plain decode step,
   launched eagerly and replayed as a CUDA graph.
3. A tiny qwen3 pair (transformers checkpoint, trained z-lab-format drafter) built by dflash-build --backend
   torch-cuda and run on the GPU: greedy outputs against the CPU (ONNX Runtime) engine's, which `--prepare` wrote
   on a CPU machine; with CUDA graphs and without, one at a time and batched by the scheduler, and streamed by a
   real tritonserver where the bundle `gpu_check.sh` unpacks is there.
4. The torch-cuda engine at Qwen3-8B target size in bf16 (random weights, so drafts are rarely accepted: the tok/s
   show the cost of a step, not DFlash's speed-up): plain decoding and DFlash, CUDA graphs on and off, at batch 1
   and 8 closed-loop clients.

--prepare DIR writes item 3's pair and expected outputs (CPU; about 2 minutes on 2 cores); --pair DIR reads them.
--smoke runs items 1, 2 and 4 at toy sizes on CPU (Triton interpreter) so CI keeps the script working.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors run interpreted

import torch.nn.functional as F  # noqa: E402
from dflash_trt.builder.checkpoints import TargetConfig, parse_target_config  # noqa: E402
from dflash_trt.builder.drafter_init import drafter_config_dict, init_drafter  # noqa: E402
from dflash_trt.builder.graphs import torch_engine  # noqa: E402
from dflash_trt.builder.networks import DrafterNetwork, TargetNetwork  # noqa: E402
from dflash_trt.plugins.block_denoise import block_denoise, block_denoise_triton  # noqa: E402
from dflash_trt.plugins.hidden_state_tap import TapWeights, hidden_state_tap, hidden_state_tap_triton  # noqa: E402
from dflash_trt.runtime.engine import GraphEngine, TorchRunner  # noqa: E402
from dflash_trt.runtime.load_bench import run_load  # noqa: E402
from dflash_trt.runtime.loop import Generation, Sequence, generate, generate_plain  # noqa: E402
from dflash_trt.runtime.sampling import SamplingParams  # noqa: E402
from dflash_trt.runtime.scheduler import Scheduler  # noqa: E402

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
    generated: int  # tokens per request in the engine runs


QWEN3_8B = Sizes(4096, 32, 8, 128, 5, 16, 16, (1024, 8192, 32768), 36, 12288, 151936, 20, 128)
SMOKE = Sizes(64, 4, 2, 32, 2, 2, 16, (40,), 2, 128, 256, 2, 16)


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


def qwen3_config(sizes: Sizes) -> TargetConfig:
    return parse_target_config({
        "model_type": "qwen3", "vocab_size": sizes.vocab, "hidden_size": sizes.hidden,
        "intermediate_size": sizes.target_intermediate, "num_hidden_layers": sizes.target_layers,
        "num_attention_heads": sizes.heads, "num_key_value_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    })  # fmt: skip


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured as a CUDA graph (after a warm-up on a side stream): a call replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.no_grad()
def check_target_step(target: TargetNetwork, sizes: Sizes, device: str, context: int = 1024) -> dict[str, object]:
    with torch.device(device):
        cache = target.allocate_cache(1, context + sizes.block)
    past = cache.past(context)

    def call(tokens: int) -> Callable[[], object]:
        ids = torch.randint(0, sizes.vocab, (1, tokens), device=device)
        positions = torch.arange(context, context + tokens, device=device)[None]
        return lambda: target(ids, positions, past, logits_to_keep=tokens)

    verify_s = median_seconds(call(sizes.block), sizes.repeats)
    decode_s = median_seconds(call(1), sizes.repeats)
    row: dict[str, object] = {"op": "target step", "context": context, "verify_16_ms": verify_s * 1e3,
                              "decode_1_ms": decode_s * 1e3, "verify_over_decode": verify_s / decode_s}  # fmt: skip
    if device == "cuda":
        verify_graph_s = median_seconds(graphed(call(sizes.block)), sizes.repeats)
        decode_graph_s = median_seconds(graphed(call(1)), sizes.repeats)
        row |= {"cuda_graph_verify_16_ms": verify_graph_s * 1e3, "cuda_graph_decode_1_ms": decode_graph_s * 1e3,
                "cuda_graph_verify_over_decode": verify_graph_s / decode_graph_s}  # fmt: skip
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
    top2 = stepwise.topk(2, dim=-1).values  # [1, S, 2]
    return row | {"verify_vs_decode_max_abs_logit_diff": (whole - stepwise).abs().max().item(),
                  "smallest_top2_logit_gap": (top2[..., 0] - top2[..., 1]).min().item(),
                  "verify_vs_decode_argmax_equal": bool(torch.equal(whole.argmax(-1), stepwise.argmax(-1)))}  # fmt: skip


def random_pair(sizes: Sizes, dtype: torch.dtype, seed: int, device: str) -> tuple[TargetNetwork, DrafterNetwork]:
    """A qwen3 target of `sizes` and a 1-layer drafter tapping 2 of its layers (1 below 4 layers), random weights,
    made on `device`."""
    config = qwen3_config(sizes)
    taps = 2 if sizes.target_layers >= 4 else 1  # (z-lab's tap placement needs 4 layers for 2 taps)
    drafter = init_drafter(drafter_config_dict(config, num_layers=1, block_size=sizes.block, num_taps=taps), seed=seed)
    torch.manual_seed(seed)
    with torch.device(device):
        target = TargetNetwork(config, tuple(drafter.config.target_layer_ids)).to(device, dtype)  # RoPE buffers too
    for parameter in target.parameters():  # decisive logits: greedy choices that rounding does not flip
        torch.nn.init.normal_(parameter, std=0.08)
    return target.eval(), drafter.to(device, dtype).eval()


def timed(decode: Callable[..., Generation], engine: GraphEngine, prompt: list[int], tokens: int) -> tuple[float, Generation]:
    decode(engine, prompt, 8)  # warm-up (and the CUDA graphs' captures)
    began = time.perf_counter()
    out = decode(engine, prompt, tokens)
    return time.perf_counter() - began, out


@torch.no_grad()
def check_engine_speed(target: TargetNetwork, drafter: DrafterNetwork, sizes: Sizes, device: str) -> list[dict[str, object]]:
    """Plain decoding and DFlash through the torch engine (the graphs dflash-build --backend torch-cuda serves):
    batch 1 with CUDA graphs on and off, then 8 closed-loop clients of each in lock step (`run_load`)."""
    prompt, max_tokens = list(range(3, 40)), sizes.generated
    engine = torch_engine(target, drafter, 2048, max_batch=17, device=device)
    runner = engine.runner
    assert isinstance(runner, TorchRunner)
    rows: list[dict[str, object]] = []
    for graphs in with_and_without_cuda_graphs(runner):
        outputs = {}
        for name, decode in (("plain", generate_plain), ("dflash", generate)):
            seconds, out = timed(decode, engine, prompt, max_tokens)
            outputs[name] = out.tokens
            rows.append({"op": "torch-cuda engine", "mode": name, "batch": 1, "cuda_graphs": graphs,
                         "target_layers": sizes.target_layers, "tokens": len(out.tokens),
                         "tok_s": len(out.tokens) / seconds, "tau": out.stats.tau})  # fmt: skip
        rows[-1]["tokens_equal_to_plain_before_first_difference"] = agreeing(outputs["dflash"], outputs["plain"])
    prompts = [[(7 * i + j) % sizes.vocab for j in range(24 + 4 * i)] for i in range(8)]
    run_load(engine, prompts, max_tokens, 8, 16, ("dflash", "plain"))  # warm round: the shapes a load meets captured
    results = run_load(engine, prompts, max_tokens, 8, 16, ("dflash", "plain"))
    for mode, result in results.items():
        summary = result.summary()
        rows.append({"op": "torch-cuda engine", "mode": mode, "clients": 8, "requests": 16,
                     "cuda_graphs": replaying(runner), "tok_s": summary["tok_s"],
                     "itl_ms_p50": summary["itl_ms_p50"], "mean_verify_width": summary["mean_verify_width"],
                     "consistent": result.consistent})  # fmt: skip
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    captures = runner.cuda_graphs.captures if runner.cuda_graphs else 0
    dflash, plain = results["dflash"].outputs, results["plain"].outputs
    rows.append({"op": "torch-cuda engine", "batched_outputs_equal": dflash == plain,
                 "tokens_equal_before_first_difference": [agreeing(dflash[n], plain[n]) for n in sorted(plain)],
                 "cuda_graph_captures": captures, "peak_gpu_gib": peak})  # fmt: skip
    return rows


def replaying(runner: TorchRunner) -> bool:
    """Whether the runner's batched graphs replay as CUDA graphs now (not off, and no capture failed)."""
    return runner.cuda_graphs is not None and runner.cuda_graphs.enabled


def with_and_without_cuda_graphs(runner: TorchRunner) -> Iterator[bool]:
    """Sets the runner to replay CUDA graphs, then to run eagerly (only eagerly where it has none), yielding whether
    it replays; restores it afterwards."""
    capturer = runner.cuda_graphs
    try:
        for graphs in (True, False) if capturer is not None else (False,):
            runner.cuda_graphs = capturer if graphs else None
            yield replaying(runner)
    finally:
        runner.cuda_graphs = capturer


def agreeing(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of `tokens` equal `reference`'s."""
    pairs = zip(tokens, reference, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(tokens), len(reference)))


PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 89], [7, 7, 7, 1, 2, 3, 4, 60, 61], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
PAIR_TOKENS = 48


def prepare(directory: Path) -> None:
    """Item 3's pair (the tiny qwen3 target of the tests, a briefly trained drafter), its ONNX Runtime build and that
    CPU engine's greedy outputs, written to `directory` for the GPU run."""
    from dflash_trt.builder.cli import main as dflash_build
    from dflash_trt.builder.tiny_checkpoints import write_tiny_target, write_trained_tiny_drafter
    from dflash_trt.runtime.repository import load_engine

    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:  # only the pair and the outputs travel to the GPU machine
        target = write_tiny_target("qwen3", directory / "target")
        drafter = write_trained_tiny_drafter(target, directory / "drafter", Path(scratch))
        repo = Path(scratch) / "onnxruntime"
        pair = ["--model", str(target), "--drafter", str(drafter), "--max-seq-len", "256", "--dtype", "float32"]
        if dflash_build([*pair, "--output", str(repo)]) != 0:
            raise RuntimeError("dflash-build failed")
        engine, _ = load_engine(repo)
        outputs = [generate(engine, prompt, PAIR_TOKENS) for prompt in PROMPTS]
    expected = {"prompts": PROMPTS, "max_tokens": PAIR_TOKENS, "tokens": [o.tokens for o in outputs],
                "accepted": [o.stats.accepted_draft_tokens for o in outputs], "engine": "onnxruntime, cpu"}  # fmt: skip
    (directory / "expected.json").write_text(json.dumps(expected))
    print(json.dumps({"prepared": str(directory), "tau": [o.stats.tau for o in outputs]}))


@torch.no_grad()
def check_pair(directory: Path, work: Path) -> list[dict[str, object]]:
    """Item 3: the prepared pair built for torch-cuda here and run on the GPU, against the CPU engine's outputs."""
    from dflash_trt.builder.cli import main as dflash_build
    from dflash_trt.runtime.repository import load_engine

    expected = json.loads((directory / "expected.json").read_text())
    repo = work / "torch-cuda"
    pair = ["--model", str(directory / "target"), "--drafter", str(directory / "drafter"), "--max-seq-len", "256"]
    if dflash_build([*pair, "--dtype", "float32", "--backend", "torch-cuda", "--output", str(repo), "--force"]) != 0:
        return [{"op": "tiny pair", "error": "dflash-build --backend torch-cuda failed"}]
    engine, manifest = load_engine(repo)
    runner = engine.runner
    assert isinstance(runner, TorchRunner)
    rows: list[dict[str, object]] = []
    sampled: list[list[int]] = []
    for graphs in with_and_without_cuda_graphs(runner):
        outputs = [generate(engine, prompt, expected["max_tokens"]) for prompt in expected["prompts"]]
        sampled.append(generate(engine, expected["prompts"][0], 32, SamplingParams(0.8, top_k=20, seed=3)).tokens)
        identical = [o.tokens for o in outputs] == expected["tokens"]
        rows.append({"op": "tiny pair", "backend": manifest["backend"], "device": str(runner.device),
                     "cuda_graphs": graphs, "greedy_identical_to_cpu_engine": identical,
                     "accepted_drafts": [o.stats.accepted_draft_tokens for o in outputs],
                     "cpu_engine_accepted_drafts": expected["accepted"]})  # fmt: skip
    rows.append({"op": "tiny pair", "seeded_sampling_identical_with_and_without_cuda_graphs": sampled[0] == sampled[-1]})
    scheduler = Scheduler(engine)
    sequences = [Sequence(prompt, expected["max_tokens"]) for prompt in expected["prompts"]]
    for sequence in sequences:
        scheduler.submit(sequence)
    while scheduler.busy:
        scheduler.step()
    rows.append({"op": "tiny pair", "batched_by_scheduler": len(sequences),
                 "greedy_identical_to_cpu_engine": [s.tokens for s in sequences] == expected["tokens"]})  # fmt: skip
    rows.append(served(repo, expected, work))
    return rows


def served(repo: Path, expected: dict[str, Any], work: Path) -> dict[str, object]:
    """The torch-cuda repository served by tritonserver: every prompt streamed over gRPC, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_trt.runtime.serve import Ports, free_port, start_server, stop_server, wait_ready

    try:
        from dflash_trt.client.triton_client import Request, stream_tokens

        ports = Ports(free_port(), free_port(), free_port())
        log = work / "tritonserver.log"
        process = start_server(repo, ports, log)
    except (ImportError, RuntimeError) as error:
        return {"op": "tiny pair served", "error": f"{type(error).__name__}: {error}"}
    try:
        ready_s = wait_ready(process, ports.http)
        request = Request(expected["max_tokens"])

        def stream(prompt: list[int]) -> list[int]:
            return [t for r in stream_tokens(f"localhost:{ports.grpc}", prompt, request) for t in r["tokens"]]

        with ThreadPoolExecutor(len(expected["prompts"])) as pool:
            tokens = list(pool.map(stream, expected["prompts"]))
        return {"op": "tiny pair served", "server": "tritonserver", "ready_s": ready_s, "concurrent_streams": len(tokens),
                "greedy_identical_to_cpu_engine": tokens == expected["tokens"]}  # fmt: skip
    except Exception as error:  # noqa: BLE001 (report, with the server's log, whatever stopped the served check)
        lines = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        return {"op": "tiny pair served", "error": f"{type(error).__name__}: {error}", "server_log_tail": lines}
    finally:
        stop_server(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes (runs on CPU through the Triton interpreter)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--prepare", type=Path, help="write the tiny pair and its CPU engine's outputs here, and stop")
    parser.add_argument("--pair", type=Path, help="a directory --prepare wrote (item 3; skipped without it)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash-gpu-check"), help="scratch directory")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("gpu_check: no CUDA GPU is visible; run with --smoke for the CPU smoke run", file=sys.stderr)
        return 2
    sizes, dtype = (SMOKE if args.smoke else QWEN3_8B), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": args.dtype}))
    sections: list[Callable[[], list[dict[str, object]]]] = [
        lambda: [check_block_denoise(sizes, context, device, dtype) for context in sizes.contexts],
        lambda: [check_hidden_state_tap(sizes, device, dtype)],
    ]
    if args.pair:
        args.work.mkdir(parents=True, exist_ok=True)
        sections.append(lambda: check_pair(args.pair, args.work))
    failed = 0
    for section in sections:
        failed += report(section)
    target, drafter = random_pair(sizes, dtype, seed=1, device=device)
    failed += report(lambda: [check_target_step(target, sizes, device)])
    failed += report(lambda: check_engine_speed(target, drafter, sizes, device))
    return 1 if failed else 0


def report(section: Callable[[], list[dict[str, object]]]) -> int:
    """Print a section's rows as JSON lines as soon as it ends; a section that raises prints its error and the others
    still run (one GPU run is all a session may get). -> 1 if it raised or a row reports an error."""
    try:
        rows = section()
    except Exception as error:  # noqa: BLE001
        print(json.dumps({"section_error": f"{type(error).__name__}: {error}"}), flush=True)
        return 1
    for row in rows:
        print(json.dumps(row), flush=True)
    return int(any("error" in row for row in rows))


if __name__ == "__main__":
    raise SystemExit(main())
