"""Fleet benchmark (issue 18), one run on one machine, greedy HumanEval prompts through the chat template:

1. aggregate throughput of 1 replica against 2 replicas behind HAProxy, each replica pinned to its own core (one
   engine thread), the same closed-loop clients and requests for both;
2. what the balancer and the OpenAI front end add at concurrency 1: TTFT and inter-token latency of one replica
   called directly (gRPC, `dflash` model), through HAProxy, and through dflash-openai (HTTP server-sent events).

    python scripts/fleet_bench.py out/smollm2 --requests 16 --clients 4 --max-tokens 64 --json docs/fleet-bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.client.triton_client import Request, Timing, stream_tokens
from dflash_trt.runtime.fleet import Fleet
from dflash_trt.runtime.prompts import encode_prompt, humaneval_prompts
from dflash_trt.runtime.serve import Ports, free_port
from transformers import AutoTokenizer


def closed_loop(url: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads take the prompts in turn until all are served: aggregate generated tokens per second."""
    queue = list(enumerate(prompts))
    lock, outputs = threading.Lock(), {}

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index, prompt = queue.pop(0)
            outputs[index] = [t for r in stream_tokens(url, prompt, Request(max_tokens)) for t in r["tokens"]]

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    tokens = sum(len(o) for o in outputs.values())
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "outputs": [outputs[i] for i in range(len(prompts))]}


def grpc_latency(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    ttfts, gaps = [], []
    for prompt in prompts:
        timing = Timing()
        list(stream_tokens(url, prompt, Request(max_tokens), timing))
        arrivals = timing.arrivals[:-1] if len(timing.arrivals) > 1 else timing.arrivals  # the last is the empty final
        ttfts.append(arrivals[0] - timing.started)
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_ms": statistics.median(ttfts) * 1e3, "inter_response_ms": statistics.median(gaps) * 1e3}


def openai_latency(base: str, texts: list[str], max_tokens: int) -> dict[str, float]:
    """Streaming chat completions over raw HTTP: the time to the first content chunk and between chunks."""
    ttfts, gaps = [], []
    for text in texts:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, "stream": True}
        post = urllib.request.Request(
            f"{base}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        began, arrivals = time.perf_counter(), []
        with urllib.request.urlopen(post, timeout=600) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    arrivals.append(time.perf_counter())
        ttfts.append(arrivals[0] - began)
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_ms": statistics.median(ttfts) * 1e3, "inter_response_ms": statistics.median(gaps) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo", type=Path)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--latency-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.repo / TOKENIZER_DIR)
    texts = humaneval_prompts(args.requests)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    work = Path(mkdtemp(prefix="fleet-bench-"))
    result: dict[str, Any] = {"requests": args.requests, "clients": args.clients, "max_tokens": args.max_tokens}

    throughput = {}
    for count in (1, 2):
        fleet = Fleet(args.repo, count, Ports(free_port(), free_port(), 0), work / f"x{count}", pin=True)
        fleet.start()
        closed_loop(f"localhost:{fleet.front.grpc}", prompts[:2], 2, 8)  # warm-up
        throughput[count] = closed_loop(f"localhost:{fleet.front.grpc}", prompts, args.clients, args.max_tokens)
        fleet.stop()
        print(f"{count} replica(s), pinned: {throughput[count]['tok_s']:.1f} tok/s", file=sys.stderr)
    result["one_replica_tok_s"] = throughput[1]["tok_s"]
    result["two_replicas_tok_s"] = throughput[2]["tok_s"]
    result["two_over_one"] = throughput[2]["tok_s"] / throughput[1]["tok_s"]
    result["outputs_identical"] = throughput[1]["outputs"] == throughput[2]["outputs"]

    # Latency at concurrency 1: one unpinned replica, reached directly, through HAProxy and through dflash-openai.
    few, few_texts = prompts[: args.latency_prompts], texts[: args.latency_prompts]
    fleet = Fleet(args.repo, 1, Ports(free_port(), free_port(), 0), work / "latency")
    fleet.start()
    replica = fleet.replicas[0]
    front_port = free_port()
    front = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_trt.client.openai_api",
            "--repo",
            str(args.repo),
            "--port",
            str(front_port),
            "--host",
            "127.0.0.1",
            "--triton-url",
            f"localhost:{replica.ports.grpc}",
        ]  # fmt: skip
    )
    try:
        grpc_latency(f"localhost:{replica.ports.grpc}", few[:1], 8)  # warm-up
        result["direct"] = grpc_latency(f"localhost:{replica.ports.grpc}", few, args.max_tokens)
        result["haproxy"] = grpc_latency(f"localhost:{fleet.front.grpc}", few, args.max_tokens)
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{front_port}/v1/models", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        openai_latency(f"http://127.0.0.1:{front_port}", few_texts[:1], 8)  # warm-up
        result["openai"] = openai_latency(f"http://127.0.0.1:{front_port}", few_texts, args.max_tokens)
    finally:
        front.terminate()
        front.wait(10)
        fleet.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
