"""The baselines dflash-bench compares the engine with, each run in a process of its own with a stated thread count.

- `transformers`: eager transformers `generate()` of the target (plain greedy or sampled decoding);
- `zlab`: the z-lab `dflash` reference (`dflash_generate`, transformers backend) on the same pair.

Both run in float32 on the same prompts and lengths as the engine. A process of its own, because the engine's
process gives torch one thread (ONNX Runtime owns the cores there): a baseline run next to it would get one core
while the engine uses all of them. `run_baseline` starts `python -m dflash_trt.runtime.baselines`, which sets
torch's thread count first and reports it with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BASELINES = ("transformers", "zlab")


@dataclass
class BaselineRuns:
    """Per prompt: decode tok/s (prefill excluded, as for the engine), TTFT, tau (z-lab only) and output tokens."""

    threads: int = 0
    rates: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class BaselineJob:
    kind: str  # one of BASELINES
    target: str
    drafter: str
    prompts: list[list[int]]
    max_tokens: int
    temperature: float


def run_baseline(job: BaselineJob, threads: int) -> BaselineRuns:
    """Run one baseline in a child process with `threads` torch threads (OMP_NUM_THREADS too)."""
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as scratch:
        request, answer = Path(scratch) / "job.json", Path(scratch) / "runs.json"
        request.write_text(json.dumps(asdict(job)))
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "dflash_trt.runtime.baselines", str(request), str(answer), "--threads", str(threads)]
        result = subprocess.run(command, env=environment, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the {job.kind} baseline failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return BaselineRuns(**json.loads(answer.read_text()))


def transformers_runs(job: BaselineJob) -> BaselineRuns:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job.target, dtype=torch.float32).eval()
    runs = BaselineRuns()
    for prompt in job.prompts:
        ids = torch.tensor([prompt])
        # An explicit all-ones mask: generate() would otherwise infer one from pad_token_id, and chat targets whose
        # pad token is their end-of-turn token (SmolLM2) would mask every earlier turn's end out of the prompt.
        # eos_token_id=[]: fixed-length output past end-of-turn, as the engine decodes here (no stop tokens).
        # pad_token_id: unused for one unpadded row, but generate() derives it from eos_token_id when unset.
        options: dict[str, Any] = {
            "attention_mask": torch.ones_like(ids), "eos_token_id": [],
            "pad_token_id": model.generation_config.pad_token_id or 0,
            "do_sample": job.temperature > 0, **({"temperature": job.temperature} if job.temperature > 0 else {}),
        }  # fmt: skip
        with torch.inference_mode():
            began = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **options)  # time to first token
            ttft = time.perf_counter() - began
            began = time.perf_counter()
            out = model.generate(ids, max_new_tokens=job.max_tokens, **options)
            total = time.perf_counter() - began
        runs.rates.append((job.max_tokens - 1) / max(total - ttft, 1e-9))
        runs.ttfts.append(ttft)
        runs.outputs.append(out[0, len(prompt) :].tolist())
    return runs


def zlab_runs(job: BaselineJob) -> BaselineRuns:
    from dflash import model as zlab
    from transformers import AutoModelForCausalLM

    # Its statistics time with torch.cuda.synchronize; on a CPU-only machine time with the same clock, unsynchronised.
    if not torch.cuda.is_available():
        zlab._cuda_time = time.perf_counter
    target = AutoModelForCausalLM.from_pretrained(job.target, dtype=torch.float32).eval()
    drafter = zlab.DFlashDraftModel.from_pretrained(job.drafter, dtype=torch.float32).eval()
    runs = BaselineRuns()
    for prompt in job.prompts:
        with torch.inference_mode():
            out = zlab.dflash_generate(
                drafter, target, torch.tensor([prompt]), job.max_tokens, None, job.temperature, return_stats=True
            )
        produced = out.num_output_tokens
        runs.rates.append((produced - 1) / (out.time_per_output_token * produced))
        runs.taus.append(statistics.mean(out.acceptance_lengths))
        runs.ttfts.append(out.time_to_first_token)
        runs.outputs.append(out.output_ids[0, len(prompt) :].tolist())
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one dflash-bench baseline (run by dflash-bench in its own process)")
    parser.add_argument("job", type=Path, help="a BaselineJob as JSON")
    parser.add_argument("answer", type=Path, help="where to write the BaselineRuns as JSON")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    job = BaselineJob(**json.loads(args.job.read_text()))
    runs = transformers_runs(job) if job.kind == "transformers" else zlab_runs(job)
    runs.threads = torch.get_num_threads()
    args.answer.write_text(json.dumps(asdict(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
