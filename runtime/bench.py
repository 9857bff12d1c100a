"""dflash-bench: DFlash vs plain decoding on the same built engine, same prompts, same process (alternating).

Reports medians and ratios measured in one run: the step engine's time for a B-token verify block against
a 1-token plain decode step, plain and DFlash tokens/s, tau, and whether T=0 outputs were identical.
`--against transformers` adds eager transformers `generate()` on the same target and prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.runtime.engine import GraphEngine
from dflash_trt.runtime.loop import Generation, generate, generate_plain
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import SamplingParams
from transformers import AutoModelForCausalLM, AutoTokenizer

BUILTIN_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that merges two sorted lists into one sorted list.",
    "Give three tips for writing readable code.",
    "Write a Python class for a simple stack with push, pop and peek.",
)


def step_timings(engine: GraphEngine, prompt: list[int], repeats: int) -> tuple[float, float]:
    """Median seconds of one fused step (verify B tokens + tap + draft) and of one plain 1-token decode step.

    Each is timed in a run of its own, as decoding uses it: alternating the two graphs makes each session's
    spinning thread pool compete with the other's on a small CPU.
    """
    caches = engine.allocate(1)
    greedy = SamplingParams()
    first = engine.prefill(caches, torch.tensor([prompt]), torch.zeros(1, 1), greedy)

    def median_seconds(call: Callable[[], object]) -> float:
        call()  # warm-up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            call()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    step = median_seconds(
        lambda: engine.step(caches, first.next_block, first.next_start, torch.zeros(1, engine.block_size), greedy)
    )
    decode = median_seconds(
        lambda: engine.decode_one(caches, first.next_block[:, 0], first.next_start, torch.zeros(1, 1), greedy)
    )
    return step, decode


def decode_rate(result: Generation) -> float:
    return (len(result.tokens) - 1) / result.stats.decode_seconds if result.stats.decode_seconds else float("nan")


def transformers_rate(target_dir: Path, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rates, outputs = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            began = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)  # time to first token
            ttft = time.perf_counter() - began
            began = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            total = time.perf_counter() - began
        rates.append((max_tokens - 1) / max(total - ttft, 1e-9))  # decode rate, prefill excluded as for the engine
        outputs.append(out[0, len(prompt) :].tolist())
    return rates, outputs


def served_rates(
    url: str, prompts: list[list[int]], max_tokens: int, in_process: list[float], plain_outputs: list[list[int]]
) -> dict[str, object]:
    """Stream the same prompts through the served `dflash` model: decode tok/s (after the first response) and TTFT."""
    from dflash_trt.client.triton_client import Request, Timing, stream_tokens

    rates, ttfts, outputs = [], [], []
    for prompt in prompts:
        timing = Timing()
        tokens = [t for response in stream_tokens(url, prompt, Request(max_tokens), timing) for t in response["tokens"]]
        last = timing.arrivals[-2] if len(timing.arrivals) > 1 else timing.arrivals[-1]  # the final response is empty
        rates.append((len(tokens) - 1) / max(last - timing.arrivals[0], 1e-9))
        ttfts.append(timing.ttft)
        outputs.append(tokens)
    return {
        "served_tok_s_median": statistics.median(rates),
        "served_over_in_process": statistics.median(rates) / statistics.median(in_process),
        "served_ttft_ms_median": statistics.median(ttfts) * 1e3,
        "served_identical": outputs == plain_outputs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-bench", description=__doc__)
    parser.add_argument("--repo", type=Path, required=True, help="a dflash-build output (model repository)")
    parser.add_argument("--dataset", choices=("builtin", "humaneval"), default="builtin")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions of the step/decode micro-benchmark")
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: the build's setting)")
    parser.add_argument("--against", choices=("transformers",), action="append", default=[])
    parser.add_argument("--served", metavar="HOST:PORT", help="also stream the prompts from a dflash-serve gRPC endpoint")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    engine, manifest = load_engine(args.repo, args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.repo / TOKENIZER_DIR)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in BUILTIN_PROMPTS
    ]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts[: args.num_prompts]]
    stop_free = args.max_tokens  # fixed-length runs: the same work for every method

    step_s, decode_s = step_timings(engine, prompts[0], args.repeats)
    plain_rates, dflash_rates, taus, identical, ttfts = [], [], [], [], []
    plain_outputs = []
    for prompt in prompts:  # alternate plain and DFlash prompt by prompt
        plain = generate_plain(engine, prompt, stop_free)
        dflash = generate(engine, prompt, stop_free)
        plain_rates.append(decode_rate(plain))
        dflash_rates.append(decode_rate(dflash))
        taus.append(dflash.stats.tau)
        ttfts.append(dflash.stats.prefill_seconds)
        identical.append(plain.tokens == dflash.tokens)
        plain_outputs.append(plain.tokens)
    results: dict[str, object] = {
        "backend": manifest["backend"],
        "block_size": engine.block_size,
        "step_ms_median": step_s * 1e3,
        "decode_ms_median": decode_s * 1e3,
        "step_over_decode": step_s / decode_s,
        "plain_tok_s_median": statistics.median(plain_rates),
        "dflash_tok_s_median": statistics.median(dflash_rates),
        "dflash_speedup": statistics.median(dflash_rates) / statistics.median(plain_rates),
        "tau_mean": statistics.mean(taus),
        "ttft_ms_median": statistics.median(ttfts) * 1e3,
        "t0_identical": all(identical),
    }
    if args.served:
        results.update(served_rates(args.served, prompts, stop_free, dflash_rates, plain_outputs))
    if "transformers" in args.against:
        rates, outputs = transformers_rate(Path(manifest["target"]["source"]), prompts, stop_free)
        results["transformers_tok_s_median"] = statistics.median(rates)
        results["plain_over_transformers"] = statistics.median(plain_rates) / statistics.median(rates)
        results["transformers_identical"] = outputs == plain_outputs
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value:.3f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
