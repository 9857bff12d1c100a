"""dflash-quality: what a quantized engine costs in quality, measured on built engines (ONNX Runtime).

- perplexity of the engine's target on held-out text (windows of `--window` tokens, each from position 0);
- top-1 agreement with a reference engine (the float32 build of the same pair): the reference decodes greedily,
  then the engine under test reads the same tokens (teacher forcing) and its argmax is compared at every
  generated position;
- engine bytes on disk.

Logits come from the engine's own `decode` graph with its LM-head output exposed, so what is measured is what
serves. tau against the float32 engine is `dflash-bench` on each build (the same drafter is in both).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import torch
from dflash_trt.builder.repository import TOKENIZER_DIR
from dflash_trt.runtime.engine import GraphEngine, StepBatch
from dflash_trt.runtime.loop import generate_plain
from dflash_trt.runtime.onnxruntime_runner import OnnxRuntimeRunner
from dflash_trt.runtime.options import require_at_least
from dflash_trt.runtime.prompts import dataset_prompts, encode_prompt
from dflash_trt.runtime.repository import engine_bytes, engine_dir_of, load_engine
from dflash_trt.runtime.sampling import RequestError, SamplingParams, SamplingTensors
from transformers import AutoTokenizer

LOGITS = "logits"  # the name the exposed LM-head output is returned under
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "docs"


def lm_head_output(model: onnx.ModelProto, vocab_size: int) -> str:
    """The output of the decode graph's LM head: its last matmul with `vocab_size` outputs (a float MatMul with a
    [hidden, vocab] weight, or a MatMulNBits with N = vocab; a projection may be as wide, but comes earlier)."""
    shapes = {tensor.name: tuple(tensor.dims) for tensor in model.graph.initializer}
    heads = [
        str(node.output[0])
        for node in model.graph.node
        if (node.op_type == "MatMulNBits" and any(a.name == "N" and a.i == vocab_size for a in node.attribute))
        or (node.op_type == "MatMul" and shapes.get(node.input[1], (0, 0))[-1:] == (vocab_size,))
    ]
    if not heads:
        raise ValueError(f"no LM-head matmul (output width {vocab_size}) in the decode graph")
    return heads[-1]


def logits_engine(repo: Path, threads: int | None) -> GraphEngine:
    """The engine with its decode graph re-opened to also return the logits of every block position."""
    engine, _ = load_engine(repo, threads, max_batch=1)
    runner = engine.runner
    assert isinstance(runner, OnnxRuntimeRunner), "dflash-quality measures ONNX Runtime engines"
    path = engine_dir_of(repo) / "decode.onnx"
    model = onnx.load(str(path))  # with the weights: the session is made from bytes
    head = lm_head_output(model, engine.vocab_size)
    model.graph.node.append(onnx.helper.make_node("Identity", [head], [LOGITS]))
    model.graph.output.append(onnx.helper.make_tensor_value_info(LOGITS, onnx.TensorProto.FLOAT, None))
    options = runner.sessions["decode"].get_session_options()
    runner.sessions["decode"] = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    runner.output_names["decode"] = [*runner.output_names["decode"], LOGITS]
    return engine


def block_logits(engine: GraphEngine, tokens: list[int]) -> torch.Tensor:
    """tokens (one sequence from position 0) -> logits [len(tokens), vocab] (float32)."""
    length = len(tokens)
    batch = StepBatch(
        slots=torch.tensor([0]),
        block=torch.tensor([tokens]),
        start=torch.tensor([0]),
        uniforms=torch.zeros(1, length),
        sampling=SamplingTensors.of([SamplingParams()], engine.vocab_size),
    )
    return engine.call("decode", batch)[LOGITS][0].float()  # [S, vocab]


def perplexity(engine: GraphEngine, token_windows: list[list[int]]) -> tuple[float, int]:
    """exp(mean next-token NLL) over every window; and how many tokens were predicted."""
    total, count = 0.0, 0
    for window in token_windows:
        logits = block_logits(engine, window)[:-1]  # [S-1, vocab]: predictions of tokens 1..S-1
        targets = torch.tensor(window[1:])
        total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return math.exp(total / count), count


def text_windows(paths: list[Path], tokenizer: Any, window: int, limit: int) -> list[list[int]]:
    """Held-out text (files, or every .md file of a directory) cut into `limit` windows of `window` tokens."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"--text {', '.join(missing)}: no such file or directory")
    files = [f for p in paths for f in (sorted(p.glob("*.md")) if p.is_dir() else [p])]
    tokens = [t for f in files for t in tokenizer(f.read_text(), add_special_tokens=False)["input_ids"]]
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - window + 1, window)][:limit]
    if not windows:
        raise ValueError(f"{', '.join(map(str, paths))}: fewer than {window} tokens of text")
    return windows


@dataclass
class Agreement:
    matches: int = 0
    positions: int = 0

    @property
    def rate(self) -> float:
        return self.matches / self.positions if self.positions else 0.0


def top1_agreement(engine: GraphEngine, reference: GraphEngine, prompts: list[list[int]], max_tokens: int) -> Agreement:
    """The reference's greedy continuation of each prompt, read by `engine`: how often its argmax is the same."""
    agreement = Agreement()
    for prompt in prompts:
        generated = generate_plain(reference, prompt, max_tokens).tokens
        logits = block_logits(engine, prompt + generated[:-1])[len(prompt) - 1 :]  # [max_tokens, vocab]
        agreement.matches += int((logits.argmax(-1) == torch.tensor(generated)).sum())
        agreement.positions += len(generated)
    return agreement


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash-quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo", type=Path, required=True, help="the engine under test (a dflash-build output)")
    parser.add_argument("--reference", type=Path, help="the float32 build of the same pair (for top-1 agreement)")
    parser.add_argument("--text", type=Path, action="append", help=f"held-out text files or directories (default {DEFAULT_TEXT})")
    parser.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--windows", type=int, default=32, help="at most this many windows")
    parser.add_argument("--num-prompts", type=int, default=20, help="per dataset (humaneval and mt-bench) for top-1 agreement")
    parser.add_argument("--max-tokens", type=int, default=128, help="reference tokens generated per prompt")
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: the build's setting)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    require_at_least(
        parser,
        {
            "--window": (args.window, 2),
            "--windows": (args.windows, 1),
            "--num-prompts": (args.num_prompts, 1),
            "--max-tokens": (args.max_tokens, 1),
        },
    )
    try:  # engines first: a path that holds none is refused before anything reads from it
        engine = logits_engine(args.repo, args.threads)
        reference = load_engine(args.reference, args.threads, max_batch=1)[0] if args.reference else None
        if args.window > engine.max_seq_len:
            raise ValueError(f"--window {args.window} exceeds the engine's maximum sequence length {engine.max_seq_len}")
        tokenizer = AutoTokenizer.from_pretrained(args.repo / TOKENIZER_DIR)
        windows = text_windows(args.text or [DEFAULT_TEXT], tokenizer, args.window, args.windows)
    except (FileNotFoundError, RuntimeError, ValueError) as error:
        parser.error(str(error))
    ppl, predicted = perplexity(engine, windows)
    results: dict[str, Any] = {
        "repo": str(args.repo),
        "engine_bytes": engine_bytes(args.repo),
        "perplexity": ppl,
        "perplexity_tokens": predicted,
    }
    if reference is not None:
        texts = [*dataset_prompts("humaneval", args.num_prompts), *dataset_prompts("mt-bench", args.num_prompts)]
        try:
            agreement = top1_agreement(engine, reference, [encode_prompt(tokenizer, t) for t in texts], args.max_tokens)
        except RequestError as error:  # a prompt and --max-tokens that do not fit the reference
            parser.error(f"--max-tokens {args.max_tokens}: {error}")
        results.update(top1_agreement=agreement.rate, top1_positions=agreement.positions)
        results["reference_engine_bytes"] = engine_bytes(args.reference)
        results["reference_perplexity"] = perplexity(logits_engine(args.reference, args.threads), windows)[0]
    for key, value in results.items():
        print(f"{key:<24}  {value:.4f}" if isinstance(value, float) else f"{key:<24}  {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
