"""What one batched call of each graph costs on a built engine, by batch size: the numbers the verify policy weighs.

For batch B (rows at `--context` positions, throw-away slots, greedy) prints the best of `--repeats` timed calls of
`decode` (plain decoding, no taps), `verify` at 1 token per row (a step verifying no draft, taps kept for the
drafter) and `step` verifying and drafting k drafts (k = 1, 2, 15), each after one untimed call of its shape:

    python scripts/step_costs.py out/smollm2-135m-dflash --batches 1,4,16,64 --threads 2

The verify/decode column is what keeping the drafter's context costs while drafting does not pay; step/decode at
k = 1 is the least a drafting step costs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.scheduler import time_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", type=Path, help="a dflash-build output directory")
    parser.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=256, help="position of every row's first verified token")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: the build's)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine, _ = load_engine(args.repo, args.threads, max(batches))
    print("batch  decode ms  verify ms  verify/decode  step k=1  step k=2  step k=15  (ms; step/decode)")
    for batch in batches:
        decode = time_call(engine, "decode", batch, 1, 1, args.context, args.repeats)
        verify = time_call(engine, "verify", batch, 1, 1, args.context, args.repeats)
        steps = [time_call(engine, "step", batch, k + 1, k, args.context, args.repeats) for k in (1, 2, 15)]
        cells = "  ".join(f"{s * 1e3:6.1f} ({s / decode:.2f}x)" for s in steps)
        print(f"{batch:>5}  {decode * 1e3:9.1f}  {verify * 1e3:9.1f}  {verify / decode:13.3f}  {cells}", flush=True)


if __name__ == "__main__":
    main()
