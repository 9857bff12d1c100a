"""Soak a served repository: C concurrent greedy clients for a while, then start-then-cancel cycles.

Starts tritonserver on REPO (free loopback ports), computes each prompt's expected output in process first, and
reports: requests served, wrong outputs, readiness failures, cancel cycles, and the resident memory of the
server's process group (tritonserver and its Python-backend stubs) after warm-up and at the end.

    python scripts/soak.py out/smollm2-135m-dflash --clients 64 --seconds 300 --cancels 1000
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.client.triton_client import Request, grpc_inputs, stream_tokens
from dflash_trt.runtime.loop import generate_plain
from dflash_trt.runtime.prompts import encode_prompt, humaneval_prompts
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.serve import Ports, free_port, start_server, stop_server, wait_ready
from transformers import AutoTokenizer

NO_END = -1  # end_id that no token has: outputs run to max_tokens, as in process


def group_rss_mib(leader: int) -> float:
    """Resident MiB of every process in the server's process group."""
    listing = subprocess.run(["ps", "-o", "rss=", "-g", str(leader)], capture_output=True, text=True).stdout
    return sum(int(x) for x in listing.split()) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", type=Path)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--cancels", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--warmup", type=float, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.repo / TOKENIZER_DIR)
    prompts = [encode_prompt(tokenizer, text) for text in humaneval_prompts(8)]
    engine, _ = load_engine(args.repo, max_batch=1)
    expected = [generate_plain(engine, p, args.max_tokens).tokens for p in prompts]
    del engine

    ports = Ports(free_port(), free_port(), free_port())
    process = start_server(args.repo, ports, Path("/tmp/soak-server.log"))
    wait_ready(process, ports.http, timeout=300)
    url = f"localhost:{ports.grpc}"
    counts = {"served": 0, "wrong": 0, "errors": 0, "not_ready": 0, "cancels": 0}
    lock = threading.Lock()
    deadline = time.perf_counter() + args.seconds
    memory: list[tuple[float, float]] = []
    began = time.perf_counter()

    def client(index: int) -> None:
        number = index
        while time.perf_counter() < deadline:
            prompt = prompts[number % len(prompts)]
            try:
                request = Request(args.max_tokens, end_id=NO_END)
                tokens = [t for r in stream_tokens(url, prompt, request) for t in r["tokens"]]
                ok = tokens == expected[number % len(prompts)]
            except Exception:  # counted, and the soak goes on
                with lock:
                    counts["errors"] += 1
                continue
            with lock:
                counts["served"] += 1
                counts["wrong"] += not ok
            number += args.clients

    def watch() -> None:
        health = grpcclient.InferenceServerClient(url)
        while time.perf_counter() < deadline:
            try:
                ready = health.is_server_ready()
            except Exception:
                ready = False
            with lock:
                counts["not_ready"] += not ready
            memory.append((time.perf_counter() - began, group_rss_mib(process.pid)))
            time.sleep(1.0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)] + [threading.Thread(target=watch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    load_seconds = time.perf_counter() - began

    for cycle in range(args.cancels):
        stream = grpcclient.InferenceServerClient(url)
        answers: queue.Queue = queue.Queue()
        stream.start_stream(callback=lambda result, error, answers=answers: answers.put((result, error)))
        prompt = np.asarray(prompts[cycle % len(prompts)], dtype=np.int64)
        inputs = grpc_inputs("input_ids", prompt, Request(200, end_id=NO_END).fields())
        stream.async_stream_infer("dflash", inputs, enable_empty_final_response=True)
        answers.get(timeout=120)
        stream.stop_stream(cancel_requests=True)
        stream.close()
        counts["cancels"] += 1
    after_cancels = group_rss_mib(process.pid)
    # Every slot is free again and a request after the cancels is still right.
    check = [t for r in stream_tokens(url, prompts[0], Request(args.max_tokens, end_id=NO_END)) for t in r["tokens"]]
    metrics = subprocess.run(["curl", "-s", f"localhost:{ports.metrics}/metrics"], capture_output=True, text=True).stdout
    free = [line for line in metrics.splitlines() if line.startswith("dflash_free_slots")]
    stop_server(process)

    warm = [m for t, m in memory if t >= args.warmup]
    report = {
        **counts,
        "clients": args.clients,
        "load_seconds": round(load_seconds, 1),
        "tokens_per_request": args.max_tokens,
        "rss_mib_after_warmup": warm[0] if warm else None,
        "rss_mib_end_of_load": warm[-1] if warm else None,
        "rss_mib_after_cancels": after_cancels,
        "rss_growth_after_warmup": (after_cancels / warm[0] - 1) if warm else None,
        "rss_mib_trace": [round(m, 1) for _, m in memory[::30]],  # every 30th sample (~1 s apart): levels off or grows on
        "post_cancel_output_correct": check == expected[0],
        "free_slots_gauge": free,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["wrong"] == 0 and report["errors"] == 0 and report["post_cancel_output_correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
