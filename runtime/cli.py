"""dflash-generate: in-process DFlash generation on the torch reference engine, streaming text and printing stats."""

from __future__ import annotations

import argparse
import sys
import time

import torch
from dflash_trt.builder.checkpoints import CheckpointError
from dflash_trt.builder.drafter_init import untrained_drafter_dir
from dflash_trt.builder.embedded import EMBEDDED_TARGET
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.models import resolve_pair
from dflash_trt.builder.networks import load_pair
from dflash_trt.runtime.detokenize import TextStream
from dflash_trt.runtime.loop import GenerationStats, StopCriteria, generate_plain, stream_dflash
from dflash_trt.runtime.options import require_at_least
from dflash_trt.runtime.prompts import encode_prompt
from dflash_trt.runtime.sampling import RequestError, SamplingParams
from transformers import AutoTokenizer

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def print_stats(stats: GenerationStats, tokens: int) -> None:
    decode_rate = (tokens - 1) / stats.decode_seconds if stats.decode_seconds > 0 else float("nan")
    print(f"\n--- DFlash: {tokens} tokens in {stats.steps} steps, finish={stats.finish_reason}", file=sys.stderr)
    print(
        f"tau (tokens/step incl. bonus) {stats.tau:.2f} | draft acceptance {stats.acceptance_rate:.1%} "
        f"({stats.accepted_draft_tokens}/{stats.draft_tokens})",
        file=sys.stderr,
    )
    print(f"TTFT {stats.prefill_seconds * 1e3:.0f} ms | decode {decode_rate:.1f} tok/s", file=sys.stderr)
    print("accepted per draft slot: " + " ".join(str(c) for c in stats.position_accept_counts), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-generate", description=__doc__)
    parser.add_argument(
        "--target", default=EMBEDDED_TARGET, help=f"'{EMBEDDED_TARGET}' (embedded CPU default) or an HF checkpoint dir"
    )
    parser.add_argument(
        "--drafter",
        help="z-lab DFlash drafter dir or hub id (the embedded target's and an alias's are named for them, as in "
        "dflash-build; otherwise default: an untrained drafter, tau ~1)",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--compare-plain", action="store_true", help="also decode plainly; report speedup and T=0 identity")
    args = parser.parse_args(argv)
    if args.seed is not None:
        require_at_least(parser, {"--seed": (args.seed, 0)})
    torch.manual_seed(0)
    try:
        target_dir, drafter_dir = resolve_pair(args.target, args.drafter)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        if drafter_dir is None:
            print("[dflash-trt] no --drafter: using an untrained drafter, so expect tau ~1", file=sys.stderr)
            drafter_dir = untrained_drafter_dir(target_dir, tokenizer, args.block_size)
        target, drafter = load_pair(target_dir, drafter_dir)
        engine = torch_engine(target, drafter, min(args.max_seq_len, target.config.max_position_embeddings), args.block_size)
        ids = encode_prompt(tokenizer, args.prompt, chat=not args.raw)
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        stop = StopCriteria(eos_token_ids=target.config.eos_token_ids)
        stats = GenerationStats(engine.block_size)
        tokens: list[int] = []
        text = TextStream(tokenizer)
        for piece in stream_dflash(engine, ids, args.max_tokens, sampling, stop, stats):
            tokens.extend(piece)
            print(text.push(piece), end="", flush=True)
    except (CheckpointError, RequestError, ValueError) as error:
        print(f"dflash-generate: error: {error}", file=sys.stderr)
        return 2
    print_stats(stats, len(tokens))
    if args.compare_plain:
        began = time.perf_counter()
        plain = generate_plain(engine, ids, args.max_tokens, sampling, stop)
        plain_rate = (len(plain.tokens) - 1) / plain.stats.decode_seconds
        dflash_rate = (len(tokens) - 1) / stats.decode_seconds
        print(
            f"plain decoding {plain_rate:.1f} tok/s ({time.perf_counter() - began:.1f} s) | "
            f"DFlash speedup {dflash_rate / plain_rate:.2f}x | "
            f"identical to plain: {plain.tokens == tokens}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
