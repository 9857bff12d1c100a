#!/usr/bin/env bash
# The main job on the embedded CPU default: build SmolLM2-135M with its shipped demo drafter, serve it with Triton, stream a
# completion over gRPC, print acceptance stats, then compare with plain decoding in-process.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
REPO=${DFLASH_DEMO_REPO:-out/smollm2-135m-dflash}
PROMPT=${DFLASH_DEMO_PROMPT:-"Write a Python function that returns the n-th Fibonacci number."}
# The drafter's side at 4 bits (--quantize-drafter int4) and drafting only token ids below 16,384 (--draft-vocab):
# drafts are verified by the float32 target, so output is unchanged and drafting costs less. A repository cached
# by an older demo or dflash-trt, or built from other drafter bytes than those shipped now, is rebuilt.
CURRENT='import json, sys; from pathlib import Path; from dflash_trt.runtime.graph_io import GRAPH_SCHEMA
from dflash_trt.builder.repository import checkpoint_hashes; m = json.load(open(sys.argv[1]))
print(m["quantization"].get("drafter", {}).get("mode") == "int4" and m["drafter"].get("vocab") == 16384
      and m.get("graph_schema") == GRAPH_SCHEMA and m["drafter"]["sha256"] == checkpoint_hashes(Path(sys.argv[2])))'
DRAFTER=builder/drafters/smollm2-135m-dflash
if [ "$("$BIN/python" -c "$CURRENT" "$REPO/dflash-manifest.json" "$DRAFTER" 2>/dev/null)" != True ]; then
  "$BIN/dflash-build" --model smollm2-135m --output "$REPO" --max-seq-len 1024 --quantize-drafter int4 --draft-vocab 16384 --force
fi
"$BIN/dflash-serve" "$REPO" --grpc-port 18001 --http-port 18000 --metrics-port 18002 > out/demo-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
"$BIN/python" - <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        if urllib.request.urlopen("http://127.0.0.1:18000/v2/health/ready", timeout=1).status == 200:
            sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit("tritonserver did not become ready; see out/demo-server.log")
PY
echo "--- streaming from tritonserver (gRPC, ensemble) ---"
"$BIN/dflash-client" "$PROMPT" --url localhost:18001 --max-tokens 128 --stats
echo "--- in-process on five HumanEval prompts: DFlash vs plain decoding on the same engine ---"
"$BIN/dflash-bench" --repo "$REPO" --dataset humaneval --num-prompts 5 --max-tokens 128 --repeats 5
