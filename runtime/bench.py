"""dflash-bench: DFlash vs plain decoding on the same built engine, same prompts, same process (alternating).

Reports medians and ratios measured in one run: plain and DFlash tokens/s and speedup; the mean time of a step
in the loop (at every context length the loop saw) against a plain step, and, at the first prompt's length, a
whole-block step against a 1-token decode; tau (tokens per step), the draft acceptance rate and the per-position
acceptance histogram; TTFT and inter-token latency; and whether T=0 outputs were identical. DFlash verifies as
`dflash-serve` does (`--verify adaptive`: the length chosen from measured costs and acceptance) or the whole block
every step (`--verify full`). Prompts go through the target's chat template, formatted as z-lab's benchmark does.
`--against transformers` adds eager transformers `generate()`, `--against zlab` the z-lab `dflash` reference
(transformers backend) on the same pair and prompts, each in a process of its own with the engine's thread
count (recorded in the results). `--rounds N` makes N passes over the prompts, pooled, and lists each pass's
pooled ratio beside the overall one. `--plot` writes a PNG (acceptance histogram, tok/s).

A `dflash-build --backend trtllm` repository runs in TensorRT-LLM's container, not here: `--served HOST:PORT
--tokenizer TARGET` then streams the prompts as text through its ensemble and reports what a client sees (decode
tok/s with tokens counted by the target's tokenizer, TTFT, the acceptance rate TensorRT-LLM reports); there is no
plain decoding on the same engine to compare with."""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from dflash_trt.builder.repository import MANIFEST, TOKENIZER_DIR, read_repository_manifest
from dflash_trt.runtime.baselines import BASELINES, BaselineJob, run_baseline
from dflash_trt.runtime.engine import GraphEngine, PrefillRow, StepBatch
from dflash_trt.runtime.load_bench import REQUESTS_PER_CLIENT, LoadSettings, load_table, slots_for
from dflash_trt.runtime.loop import Generation, generate, generate_plain, validate_request
from dflash_trt.runtime.options import require_at_least
from dflash_trt.runtime.prompts import dataset_prompts, encode_prompt, prompt_text
from dflash_trt.runtime.repository import engine_bytes, load_engine, session_settings, single_rows_padded
from dflash_trt.runtime.sampling import RequestError, SamplingParams, SamplingTensors
from dflash_trt.runtime.scheduler import LOOKUP_LIMIT, PREFILL_CHUNK, AdaptiveVerify, FixedVerify, VerifyPolicy
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def step_timings(engine: GraphEngine, prompt: list[int], repeats: int) -> tuple[float, float]:
    """Median seconds of one fused step (verify B tokens + tap + draft) and of one plain 1-token decode step.

    Each is timed in a run of its own, as decoding uses it: alternating the two graphs makes each session's
    spinning thread pool compete with the other's on a small CPU.
    """
    slot = engine.pool.acquire()
    greedy = SamplingParams()
    first = engine.prefill([PrefillRow(slot, prompt, 0.0, greedy)])

    def call(graph: str, width: int) -> StepBatch:
        sampling = SamplingTensors.of([greedy], engine.vocab_size)
        return StepBatch(torch.tensor([slot]), first.next_block[:, :width], first.next_start, torch.zeros(1, width), sampling)

    def median_seconds(graph: str, width: int) -> float:
        batch = call(graph, width)
        engine.run(graph, batch)  # warm-up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            engine.run(graph, batch)
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    try:
        return median_seconds("step", engine.block_size), median_seconds("decode", 1)
    finally:
        engine.pool.release(slot)


def engine_threads(manifest: dict[str, Any], threads: int | None) -> int:
    """The engine's intra-op threads (ONNX Runtime: --threads, else the build's session setting), which every
    baseline then gets too."""
    if manifest["backend"] != "onnxruntime":
        return torch.get_num_threads()
    return session_settings(manifest, threads).threads


def decode_rate(result: Generation) -> float:
    return (len(result.tokens) - 1) / result.stats.decode_seconds if result.stats.decode_seconds else float("nan")


def pooled_decode_rate(results: list[Generation]) -> float:
    """Decode tokens per second over all prompts together: every step weighs the same, where the median of
    per-prompt rates weighs prompts (and moves by a few percent between runs of the same code on a busy machine)."""
    seconds = sum(r.stats.decode_seconds for r in results)
    return sum(len(r.tokens) - 1 for r in results) / seconds if seconds else float("nan")


def step_ms(result: Generation) -> float:
    """Mean milliseconds per step of a whole generation: the steps at the context lengths the loop saw."""
    return 1e3 * result.stats.decode_seconds / max(result.stats.steps, 1)


def inter_token_ms(result: Generation) -> float:
    """Mean time per generated token after the first (DFlash emits tokens in bursts of tau)."""
    return 1e3 / decode_rate(result)


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


def served_text_rates(url: str, texts: list[str], max_tokens: int, tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """Stream the prompts as text through a served ensemble (a --backend trtllm repository): decode tok/s after the
    first response (its tokens counted with `tokenizer`), TTFT, and the draft acceptance the engine reports."""
    from dflash_trt.client.triton_client import Request, Timing, stream_text

    rates, ttfts, accepted, drafted = [], [], 0, 0
    for text in texts:
        timing = Timing()
        pieces = list(stream_text(url, text, Request(max_tokens), timing))
        first = len(tokenizer(pieces[0]["text"], add_special_tokens=False)["input_ids"])
        tokens = len(tokenizer("".join(p["text"] for p in pieces), add_special_tokens=False)["input_ids"])
        rates.append((tokens - first) / max(timing.arrivals[-1] - timing.arrivals[0], 1e-9))
        ttfts.append(timing.ttft)
        accepted += int(pieces[-1].get("total_accepted_draft_tokens", 0))
        drafted += int(pieces[-1].get("total_draft_tokens", 0))
    return {
        "served_tok_s_median": statistics.median(rates),
        "served_ttft_ms_median": statistics.median(ttfts) * 1e3,
        "served_acceptance_rate": accepted / drafted if drafted > 0 else "not reported",
    }


def bench_served_repository(args: argparse.Namespace, parser: argparse.ArgumentParser, manifest: dict[str, Any]) -> int:
    """A repository another engine serves (--backend trtllm): measured as a client through its ensemble."""
    if not (args.served and args.tokenizer):
        parser.error(
            f"{args.repo} is served by TensorRT-LLM in its container, not run here: pass --served HOST:PORT (its "
            "tritonserver's gRPC port) and --tokenizer (the target's) to measure it as a client does"
        )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    try:
        texts = [prompt_text(tokenizer, text) for text in dataset_prompts(args.dataset, args.num_prompts)]
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    results: dict[str, Any] = {
        "backend": manifest["backend"],
        "parallel": manifest.get("parallel"),
        "served": args.served,
        "dataset": args.dataset,
        "prompts": len(texts),
        "max_tokens": args.max_tokens,
        **served_text_rates(args.served, texts, args.max_tokens, tokenizer),
    }
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


@dataclass
class EngineRuns:
    """Per prompt and round (round-major): plain and DFlash on the same engine, alternating."""

    prompts: int
    plain: list[Generation] = field(default_factory=list)
    dflash: list[Generation] = field(default_factory=list)

    def pooled_speedup_by_round(self) -> list[float]:
        """Each round's DFlash over plain decode rate, all its prompts pooled."""
        rounds = range(0, len(self.plain), self.prompts)
        return [pooled_decode_rate(self.dflash[i : i + self.prompts]) / pooled_decode_rate(self.plain[i : i + self.prompts])
                for i in rounds]  # fmt: skip

    def all_equal_plain(self) -> bool:
        """Every DFlash output, in every round, equals the first round's plain output for its prompt (and so does every
        later round's plain output: greedy decoding repeats itself)."""
        first = [r.tokens for r in self.plain[: self.prompts]]
        return all(r.tokens == first[i % self.prompts] for runs in (self.plain, self.dflash) for i, r in enumerate(runs))


def verify_policy(engine: GraphEngine, verify: str, lookup_drafts: int = LOOKUP_LIMIT) -> VerifyPolicy:
    """ "adaptive": what `dflash-serve` runs (calibrated once, then learning across the prompts as a server does),
    with lookup drafts of up to `lookup_drafts` tokens on steps that draft nothing and before the drafter's drafts on
    steps that draft (0: none); "full": the whole block every step (z-lab's loop: its tau is the drafter's, comparable
    with z-lab's)."""
    if verify == "full":
        return FixedVerify(engine.block_size - 1)
    return AdaptiveVerify.calibrated(engine, lookup_drafts)


def concurrency_levels(option: str, parser: argparse.ArgumentParser) -> list[int]:
    """--concurrency "1,4,16" -> [1, 4, 16]; anything but positive whole numbers is a usage error."""
    try:
        levels = [int(level) for level in option.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        parser.error(f"--concurrency {option!r}: give comma-separated client counts of at least 1, e.g. 1,4,16,64")
    return levels


def run_engine(
    engine: GraphEngine,
    prompts: list[list[int]],
    max_tokens: int,
    sampling: SamplingParams,
    policy: VerifyPolicy,
    rounds: int = 1,
) -> EngineRuns:
    """`rounds` passes over the prompts, plain then DFlash on each; one policy throughout, learning as a server's does."""
    runs = EngineRuns(len(prompts))
    for round_number, (number, prompt) in itertools.product(range(1, rounds + 1), enumerate(prompts, 1)):
        runs.plain.append(generate_plain(engine, prompt, max_tokens, sampling))
        runs.dflash.append(generate(engine, prompt, max_tokens, sampling, policy=policy))
        where = f"round {round_number}/{rounds}, " if rounds > 1 else ""
        tau = runs.dflash[-1].stats.tau
        print(f"[dflash-bench] {where}prompt {number}/{len(prompts)}: tau {tau:.2f}", file=sys.stderr, flush=True)
    return runs


def acceptance_summary(runs: list[Generation], block_size: int) -> dict[str, object]:
    """tau, draft acceptance rate, per-position acceptance (fraction of steps whose draft slot k was accepted), the
    drafter's conditional acceptance (of the steps that verified slot k with the slots before it accepted, the share
    that accepted it: what the drafter achieves whatever verify lengths were chosen; listed up to the last slot ever
    reached) and the histogram of tokens emitted per step (1..B), pooled over all prompts."""
    steps = sum(r.stats.steps for r in runs)
    accepted = [sum(r.stats.position_accept_counts[k] for r in runs) for k in range(block_size - 1)]
    reached = [sum(r.stats.position_reached_counts[k] for r in runs) for k in range(block_size - 1)]
    per_slot = [a / max(steps, 1) for a in accepted]
    conditional = [a / n for a, n in zip(accepted, reached, strict=True) if n]  # reached slots are a prefix
    lengths = [n for r in runs for n in r.stats.acceptance_lengths]
    drafted = sum(r.stats.draft_tokens for r in runs)
    return {
        "tau_mean": statistics.mean(r.stats.tau for r in runs),
        "draft_acceptance_rate": sum(accepted) / max(drafted, 1),
        "accepted_per_position": per_slot,
        "conditional_acceptance_per_position": conditional,
        "tokens_per_step_histogram": [lengths.count(n) for n in range(1, block_size + 1)],
        "lookup_drafts_verified": sum(r.stats.lookup_tokens for r in runs),  # `runtime.lookup`: not the drafter's
        "lookup_drafts_accepted": sum(r.stats.lookup_accepted for r in runs),
        "lookup_drafts_in_drafting_steps": sum(r.stats.lookup_in_blocks for r in runs),  # in the counts above
    }


def write_plot(results: dict[str, Any], path: Path) -> None:
    """PNG: per-position acceptance and tokens-per-step histogram (DFlash), and tok/s of every method."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("dflash-bench: error: --plot needs matplotlib: pip install 'dflash-trt[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accept, lengths, speed) = plt.subplots(1, 3, figsize=(15, 4))
    per_slot = results["accepted_per_position"]
    accept.bar(range(1, len(per_slot) + 1), per_slot)
    accept.set(title="draft acceptance by position", xlabel="draft slot", ylabel="fraction of steps accepted", ylim=(0, 1))
    histogram = results["tokens_per_step_histogram"]
    lengths.bar(range(1, len(histogram) + 1), histogram)
    lengths.set(title=f"tokens per step (tau {results['tau_mean']:.2f})", xlabel="tokens emitted", ylabel="steps")
    methods = {k.removesuffix("_tok_s_median"): v for k, v in results.items() if k.endswith("_tok_s_median")}
    speed.bar(list(methods), list(methods.values()))
    speed.set(title=f"decode tok/s ({results['dataset']}, {results['max_tokens']} tokens)", ylabel="tokens/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo", type=Path, required=True, help="a dflash-build output (model repository)")
    parser.add_argument(
        "--dataset",
        default="builtin",
        help="builtin | humaneval | mt-bench (first turns), each optionally @FIRST (humaneval@20: from HumanEval/20 on) | "
        "FILE (JSON lines with a 'prompt')",
    )
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (fixed length: no stop tokens)")
    parser.add_argument("--block-size", type=int, help="must equal the engine's block size (it is compiled in)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs must then be identical)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0")
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions of the step/decode micro-benchmark")
    parser.add_argument(
        "--threads",
        type=int,
        help="ONNX Runtime intra-op threads, and the baselines' torch threads (default: the build's setting)",
    )
    parser.add_argument(
        "--verify",
        choices=("adaptive", "full"),
        default="adaptive",
        help="DFlash's verify length: adaptive = what dflash-serve runs (chosen from measured costs and acceptance); "
        "full = the whole block every step (z-lab's loop: tau is then the drafter's, comparable with --against zlab)",
    )
    parser.add_argument(
        "--lookup-drafts",
        type=int,
        default=LOOKUP_LIMIT,
        help=f"with --verify adaptive: lookup drafts (the text's own repetitions, runtime/lookup.py) of up to this many "
        f"tokens, verified on steps that verify none of the drafter's where they pay, and put before the drafter's "
        f"drafts on steps that draft (default {LOOKUP_LIMIT}; 0: none); with --concurrency, for DFlash and one at a time",
    )
    parser.add_argument(
        "--against",
        choices=BASELINES,
        action="append",
        default=[],
        help="also run this baseline on the same prompts, in a process of its own with the engine's thread count",
    )
    parser.add_argument("--served", metavar="HOST:PORT", help="also stream the prompts from a dflash-serve gRPC endpoint")
    parser.add_argument("--tokenizer", help="a --backend trtllm repository: the target's tokenizer (directory or hub id)")
    parser.add_argument(
        "--concurrency",
        help="comma-separated client counts (e.g. 1,4,16,64): measure in-flight batching under load instead "
        "(DFlash batched vs one at a time vs plain batched decoding, same engine)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="passes over the prompts, pooled (default 1; 2 with --concurrency): one stream runs plain and DFlash "
        "alternating per prompt in every round and also reports each round's pooled ratio, to show the spread; "
        "with --concurrency, rounds of the three modes (at each level DFlash and plain batched side by side in "
        "lock step, and one at a time taking turns with them in slices of a few seconds, each timed on its own clock, "
        "so a drift in the machine's speed weighs on all alike)",
    )
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=REQUESTS_PER_CLIENT,
        help="with --concurrency: about this many requests from each client per run, in whole passes over the "
        f"prompts (default {REQUESTS_PER_CLIENT}: the batch stays full for most of the run instead of draining)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=PREFILL_CHUNK,
        help="with --concurrency: prompt tokens prefilled between two steps while other requests generate, as the "
        f"served model's prefill_chunk_tokens (default {PREFILL_CHUNK}; 0: each prompt whole)",
    )
    parser.add_argument(
        "--length-spread",
        type=float,
        default=0.0,
        help="with --concurrency: each prompt's requests ask for --max-tokens x a factor of its own, spread evenly over "
        "1 - S .. 1 + S (mean 1; default 0: all ask --max-tokens, so plain decoding's closed-loop clients finish and "
        "are readmitted together, in waves)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG: acceptance histogram and tok/s")
    args = parser.parse_args(argv)

    levels = concurrency_levels(args.concurrency, parser) if args.concurrency else []
    limits = {"--num-prompts": (args.num_prompts, 1), "--max-tokens": (args.max_tokens, 1), "--repeats": (args.repeats, 1)}
    limits["--lookup-drafts"] = (args.lookup_drafts, 0)
    if args.threads is not None:
        limits["--threads"] = (args.threads, 0)  # 0: one per core
    require_at_least(parser, limits)
    if args.rounds is None:
        args.rounds = 2 if levels else 1
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: run at least one round")
    if args.requests_per_client < 1:
        parser.error(f"--requests-per-client {args.requests_per_client}: each client sends at least one request")
    if args.prefill_chunk < 0:
        parser.error(f"--prefill-chunk {args.prefill_chunk}: give prompt tokens per step, or 0 to prefill whole prompts")
    try:
        load_settings = LoadSettings(args.prefill_chunk, args.lookup_drafts, args.length_spread)
    except ValueError:
        parser.error(f"--length-spread {args.length_spread}: give a share in [0, 1), e.g. 0.5 for 0.5x-1.5x --max-tokens")
    repository = read_repository_manifest(args.repo) if (args.repo / MANIFEST).is_file() else {}
    if repository.get("backend") == "trtllm":
        return bench_served_repository(args, parser, repository)
    try:
        # One prompt at a time, plain then DFlash: each prefills whole, so their times to first token compare the
        # modes (DFlash would otherwise start from the rows plain decoding just left).
        engine, manifest = load_engine(args.repo, args.threads, slots_for(levels) if levels else 1, reuse_prefixes=bool(levels))
    except (FileNotFoundError, RuntimeError) as refusal:  # no engine there, or one this runtime cannot run here
        parser.error(str(refusal))
    if args.block_size is not None and args.block_size != engine.block_size:
        parser.error(
            f"--block-size {args.block_size}: this engine was built with block size {engine.block_size}; "
            f"rebuild with dflash-build --block-size {args.block_size} (or drop the option)"
        )
    if args.lookup_drafts >= engine.block_size:
        parser.error(f"--lookup-drafts {args.lookup_drafts}: a step verifies at most {engine.block_size - 1} drafts on "
                     f"this engine (block size {engine.block_size}); give at most that, or 0 for none")  # fmt: skip
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed if args.temperature > 0 else None)
    try:
        sampling.validate()
        texts = dataset_prompts(args.dataset, args.num_prompts)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    tokenizer = AutoTokenizer.from_pretrained(args.repo / TOKENIZER_DIR)
    prompts = [encode_prompt(tokenizer, text) for text in texts]
    longest = max(load_settings.lengths(args.max_tokens, len(prompts))) if levels else args.max_tokens
    for number, prompt in enumerate(prompts, 1):
        try:
            validate_request(prompt, longest, engine, sampling)
        except RequestError as error:
            parser.error(f"prompt {number} of --dataset {args.dataset}: {error}")
    greedy = args.temperature == 0

    if levels:
        rows = load_table(engine, prompts, args.max_tokens, levels, args.rounds, args.requests_per_client, load_settings)
        if args.json:
            settings = {
                "threads": args.threads,
                "max_tokens": args.max_tokens,
                "dataset": args.dataset,
                "prompts": len(prompts),
                "rounds": args.rounds,
                "requests_per_client": args.requests_per_client,
                "prefill_chunk": args.prefill_chunk,
                "lookup_drafts": args.lookup_drafts,
                "length_spread": args.length_spread,
            }
            args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
        return 0
    threads = engine_threads(manifest, args.threads)
    step_s, decode_s = step_timings(engine, prompts[0], args.repeats)
    policy = verify_policy(engine, args.verify, args.lookup_drafts)
    runs = run_engine(engine, prompts, args.max_tokens, sampling, policy, args.rounds)
    plain_rates, dflash_rates = [decode_rate(r) for r in runs.plain], [decode_rate(r) for r in runs.dflash]
    plain_outputs = [r.tokens for r in runs.plain[: len(prompts)]]  # the first round's
    dflash_step_ms = statistics.median(step_ms(r) for r in runs.dflash)
    plain_step_ms = statistics.median(step_ms(r) for r in runs.plain)
    quantization = manifest.get("quantization", {"mode": "none"})
    results: dict[str, Any] = {
        "backend": manifest["backend"],
        "quantization": quantization["mode"],
        "drafter_quantization": quantization.get("drafter", quantization)["mode"],
        "draft_vocab": manifest["drafter"].get("vocab"),  # token ids the drafter may propose (dflash-build --draft-vocab)
        "single_rows_padded": single_rows_padded(manifest),  # one-row calls run as two (AVX2 int4)
        "engine_bytes": engine_bytes(args.repo),
        "engine_threads": threads,
        "dataset": args.dataset,
        "prompts": len(prompts),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "block_size": engine.block_size,
        "verify": args.verify,
        "lookup_drafts": policy.lookup_limit,
        "full_step_ms_at_first_prompt": step_s * 1e3,
        "decode_ms_at_first_prompt": decode_s * 1e3,
        "full_step_over_decode_at_first_prompt": step_s / decode_s,
        "dflash_step_ms_median": dflash_step_ms,  # in the loop, at every context length it saw
        "plain_step_ms_median": plain_step_ms,
        "dflash_step_over_plain_step": dflash_step_ms / plain_step_ms,
        "plain_tok_s_median": statistics.median(plain_rates),
        "dflash_tok_s_median": statistics.median(dflash_rates),
        "dflash_speedup": statistics.median(dflash_rates) / statistics.median(plain_rates),
        "dflash_speedup_pooled": pooled_decode_rate(runs.dflash) / pooled_decode_rate(runs.plain),  # total tokens / time
        "dflash_speedup_pooled_by_round": runs.pooled_speedup_by_round(),
        **acceptance_summary(runs.dflash, engine.block_size),
        "ttft_ms_median": statistics.median(r.stats.prefill_seconds for r in runs.dflash) * 1e3,
        "inter_token_ms_median": statistics.median(inter_token_ms(r) for r in runs.dflash),
        "plain_inter_token_ms_median": statistics.median(inter_token_ms(r) for r in runs.plain),
        "t0_identical": runs.all_equal_plain() if greedy else "n/a (T>0)",
    }
    if args.served:
        results.update(served_rates(args.served, prompts, args.max_tokens, dflash_rates, plain_outputs))
    for kind in args.against:
        print(f"[dflash-bench] {kind} baseline ({threads} torch threads, a process of its own) ...", file=sys.stderr)
        job = BaselineJob(kind, manifest["target"]["source"], manifest["drafter"]["source"], prompts, args.max_tokens,
                          args.temperature)  # fmt: skip
        baseline = run_baseline(job, threads)
        results[f"{kind}_threads"] = baseline.threads
        results[f"{kind}_tok_s_median"] = statistics.median(baseline.rates)
        results[f"{kind}_ttft_ms_median"] = statistics.median(baseline.ttfts) * 1e3
        if baseline.taus:
            results[f"{kind}_tau_mean"] = statistics.mean(baseline.taus)
        results[f"plain_over_{kind}"] = statistics.median(plain_rates) / results[f"{kind}_tok_s_median"]
        results[f"dflash_over_{kind}"] = statistics.median(dflash_rates) / results[f"{kind}_tok_s_median"]
        results[f"{kind}_identical"] = baseline.outputs == plain_outputs if greedy else "n/a (T>0)"
    results["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process: engine and pool
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        write_plot(results, args.plot)
        print(f"[dflash-bench] plot written to {args.plot}", file=sys.stderr)
    return 0


def print_table(results: dict[str, Any]) -> None:
    width = max(len(k) for k in results)
    for key, value in results.items():
        if isinstance(value, float):
            shown = f"{value:.3f}"
        elif isinstance(value, list) and value and isinstance(value[0], float):
            shown = " ".join(f"{v:.2f}" for v in value)
        else:
            shown = str(value)
        print(f"{key:<{width}}  {shown}")


if __name__ == "__main__":
    sys.exit(main())
