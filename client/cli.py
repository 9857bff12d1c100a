"""dflash-client: stream a completion from a served dflash model repository (gRPC by default, or HTTP)."""

from __future__ import annotations

import argparse
import sys

from dflash_trt.client.triton_client import (
    Request,
    Retry,
    ServerError,
    Timing,
    http_generate_stream,
    stream_text,
)
from dflash_trt.runtime.options import require_at_least


def format_stats(last: dict[str, object], timing: Timing) -> str:
    """tau, acceptance rate, TTFT, inter-response latency and tok/s from the final response's counters (a counter the
    engine does not report is negative: TensorRT-LLM's llmapi model reports no step or token count)."""
    steps, tokens = int(last.get("total_steps", 0)), int(last.get("total_output_tokens", 0))  # type: ignore[call-overload]
    draft, accepted = int(last.get("total_draft_tokens", 0)), int(last.get("total_accepted_draft_tokens", 0))  # type: ignore[call-overload]
    elapsed = timing.arrivals[-1] - timing.started if timing.arrivals else float("nan")
    tau = f"{(tokens - 1) / steps:.2f}" if steps > 0 and tokens > 0 else "n/a"  # the first token comes from prefill
    speed = f"{tokens / elapsed:.1f} tok/s ({tokens} tokens in {elapsed:.2f} s)" if tokens >= 0 else f"{elapsed:.2f} s"
    return (
        f"tau {tau} | acceptance rate {accepted / draft if draft else 0.0:.1%} ({accepted}/{draft} draft tokens) | "
        f"TTFT {timing.ttft * 1e3:.0f} ms | inter-response {timing.inter_token * 1e3:.0f} ms | {speed}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-client", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--url", help="gRPC host:port (default localhost:8001) or, with --http, http://host:port (default :8000)")
    parser.add_argument("--http", action="store_true", help="use Triton's HTTP generate / generate_stream endpoints")
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="print the text at the end (gRPC: one response from the server; HTTP: still streamed, so Ctrl-C stops it)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stats", action="store_true", help="print the draft acceptance rate, TTFT and inter-response latency")
    parser.add_argument(
        "--retries",
        type=int,
        default=Retry().tries - 1,
        help="gRPC: times to ask again when the stream breaks before the final response (a replica died); greedy and "
        "seeded requests resume where they broke, 0 turns it off (default %(default)s)",
    )
    args = parser.parse_args(argv)
    require_at_least(parser, {"--max-tokens": (args.max_tokens, 1), "--retries": (args.retries, 0)})
    # Triton's HTTP frontend notices a client gone only when it writes to it (triton-inference-server/server issue
    # 7077): a request answered whole would run to its end after Ctrl-C, so over HTTP it always streams
    streamed = args.http or not args.no_stream
    request = Request(args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed, None, tuple(args.stop), streamed)
    url = args.url or ("http://localhost:8000" if args.http else "localhost:8001")
    timing = Timing()
    last: dict[str, object] = {}
    try:
        pieces = (
            http_generate_stream(url, args.prompt, request, timing)
            if args.http
            else stream_text(url, args.prompt, request, timing, Retry(tries=1 + args.retries))
        )
        held = []  # --no-stream: the text, printed at the end
        for piece in pieces:
            if args.no_stream:
                held.append(piece["text"])
            else:
                print(piece["text"], end="", flush=True)
            last = piece
        print("".join(held), end="")
    except (ServerError, OSError) as error:
        print(f"\ndflash-client: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the request was cancelled on the server as the stream closed
        print("\ndflash-client: interrupted (request cancelled)", file=sys.stderr)
        return 130
    print()
    if args.stats and last:
        print(format_stats(last, timing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
