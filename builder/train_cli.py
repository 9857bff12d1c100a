"""dflash-train: train a DFlash drafter for a target on the target's own responses (CPU or GPU, same code).

1. prompt sets ("code": standard-library functions; "code-puzzles": HumanEval-shaped self-written puzzles;
   "prose": writing tasks; all disjoint from HumanEval/MT-Bench)
2. the target answers them greedily, in batches of equal-length prompts            (cached: OUTPUT/data-SET.pt)
   (torch, or with --generate-with REPO that target's built engine in a child process: plain batched decoding,
   faster on CPUs)
3. optional corpora ("stdlib-source"): windows of real text the target reads, teacher-forced (cheap: no generation)
4. tap the target at every position of every sequence        (kept for a resumed run until training ends: OUTPUT/taps.pt)
5. train with many random anchors per sequence, position-weighted CE towards the target's greedy tokens
                                                                                   (resumable: OUTPUT/checkpoint.pt)
6. write the drafter in z-lab format                                               (OUTPUT/config.json, model.safetensors)
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch
from dflash_trt.builder.checkpoints import CheckpointError, parse_drafter_config, parse_target_config, read_config_json
from dflash_trt.builder.draft_vocab import check_draft_vocab
from dflash_trt.builder.drafter_init import choose_mask_token_id, drafter_config_dict, init_drafter, save_drafter
from dflash_trt.builder.models import resolve_checkpoint
from dflash_trt.builder.networks import DrafterNetwork, load_target
from dflash_trt.builder.repository import checkpoint_hashes
from dflash_trt.builder.train_data import CORPORA, PROMPT_SETS, corpus_windows
from dflash_trt.builder.training import (
    TrainSettings,
    examples_fingerprint,
    generate_responses,
    load_examples,
    make_examples,
    save_examples,
    train_drafter,
)
from dflash_trt.runtime.loop import Sequence
from dflash_trt.runtime.options import require_at_least
from dflash_trt.runtime.prompts import encode_prompt
from dflash_trt.runtime.repository import engine_dir_of, load_engine, read_manifest
from dflash_trt.runtime.sampling import RequestError
from dflash_trt.runtime.scheduler import PlainDecoding, Scheduler
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def log(message: str) -> None:
    print(f"[dflash-train] {message}", file=sys.stderr, flush=True)


Responder = Callable[[list[list[int]], int], list[torch.Tensor]]  # (prompts, max_new_tokens) -> prompt + answer each


class GenerationProgress:
    """A log line per batch of finished answers, with the rate so far."""

    def __init__(self, total: int, max_new_tokens: int) -> None:
        self.total, self.max_new_tokens, self.began = total, max_new_tokens, time.perf_counter()

    def report(self, done: int) -> None:
        rate = done * self.max_new_tokens / (time.perf_counter() - self.began)
        log(f"generated {done}/{self.total} responses ({rate:.0f} response tok/s)")


def torch_responder(target_dir: Path, batch_size: int) -> Responder:
    """The target in torch (float32, loaded once, when a set first needs answers) answers `batch_size` prompts at a
    time (see generate_responses)."""
    load = functools.cache(lambda: load_target(target_dir, dtype=torch.float32))

    def respond(prompts: list[list[int]], max_new_tokens: int) -> list[torch.Tensor]:
        target = load()
        progress, sequences = GenerationProgress(len(prompts), max_new_tokens), []
        for first in range(0, len(prompts), batch_size):
            sequences.extend(generate_responses(target, prompts[first : first + batch_size], max_new_tokens))
            progress.report(len(sequences))
        return sequences

    return respond


def engine_responder(repository: Path, target_dir: Path, slots: int) -> Responder:
    """The target's engine in a dflash-build output answers with plain batched greedy decoding over `slots` slots,
    prompts joining as others finish (in a child process per prompt set that needs answers). Only an engine of
    this very target (same checkpoint bytes), unquantized and in float32, is taken: its answers are then the
    target's greedy answers, as torch's are (up to CPU kernels' rounding at near ties, as on another machine)."""
    try:
        manifest = read_manifest(engine_dir_of(repository))
    except FileNotFoundError as error:
        raise CheckpointError(f"--generate-with {repository}: {error}") from None
    built_from = manifest["target"]
    if built_from["sha256"] != checkpoint_hashes(target_dir):
        raise CheckpointError(
            f"--generate-with {repository} was built from another target ({built_from['source']}) than {target_dir}: "
            "its answers would not be this target's; pass a repository that dflash-build made from this target"
        )
    mode, dtype = manifest.get("quantization", {}).get("mode", "none"), manifest["engine"]["dtype"]
    if (mode, dtype) != ("none", "float32"):
        raise CheckpointError(
            f"--generate-with {repository} holds a {dtype} engine quantized as '{mode}': its answers are not the "
            "float32 target's; build one with --dtype float32 --quantize none (the drafter may be quantized)"
        )

    log(f"answers come from the engine in {repository} ({slots} slots, plain batched greedy decoding, in a child process)")

    def respond(prompts: list[list[int]], max_new_tokens: int) -> list[torch.Tensor]:
        # A child process per prompt set (a process start and an engine load each): the engine's runner sets torch to one
        # thread while ONNX Runtime owns the cores, and in this process, even with torch's threads restored after the
        # answers, the training steps that follow ran ~20% slower (1.2 s against 1.0 on a 2-core EPYC).
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
            try:
                answers = child.submit(answer_with_engine, repository, slots, prompts, max_new_tokens).result()
            except RequestError as error:
                raise CheckpointError(f"--generate-with {repository}: {error}") from None
            except BrokenProcessPool as error:
                message = f"--generate-with {repository}: the process answering the prompts died ({error}; killed for memory?)"
                raise CheckpointError(message) from None
        return [torch.tensor(ids) for ids in answers]

    return respond


def answer_with_engine(repository: Path, slots: int, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """(In engine_responder's child process.) Each prompt followed by the engine's plain batched greedy answer, prompts
    joining the `slots` slots as others finish, with a log line per `slots` answers (as torch's per batch)."""
    engine = load_engine(repository, max_batch=slots, reuse_prefixes=False)[0]
    scheduler = Scheduler(engine, PlainDecoding())
    answers = [Sequence(prompt, max_new_tokens) for prompt in prompts]
    for answer in answers:
        scheduler.submit(answer)
    progress, done, next_report = GenerationProgress(len(prompts), max_new_tokens), 0, min(slots, len(prompts))
    while scheduler.busy:
        done += sum(sequence.finished for sequence, _ in scheduler.step())
        if done >= next_report:
            progress.report(done)
            next_report = min(done + slots, len(prompts))
    return [answer.prompt + answer.tokens for answer in answers]


def generate_data(
    respond: Responder, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int
) -> dict[str, Any]:
    """The target's greedy responses to prompts sorted by token length. The record keeps the prompts and length it
    was made from, so a cache can be checked against a later run."""
    encoded = sorted((encode_prompt(tokenizer, text) for text in prompts), key=len)
    return {
        "sequences": respond(encoded, max_new_tokens), "prompt_lengths": [len(ids) for ids in encoded],
        "prompts": prompts, "max_new_tokens": max_new_tokens,
    }  # fmt: skip


def load_or_generate(
    output: Path, set_name: str, respond: Responder, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, num_prompts: int
) -> dict[str, Any]:
    """One prompt set's responses, generated once and cached in output/data-SET.pt (a set is generated on its own,
    so adding a set never changes another set's data). A cache made from other prompts or another length is refused."""
    path = output / f"data-{set_name}.pt"
    prompts = PROMPT_SETS[set_name]()[: num_prompts or None]
    if path.is_file():
        data: dict[str, Any] = torch.load(path)
        if (len(data["sequences"]), data.get("max_new_tokens")) != (len(prompts), max_new_tokens):
            raise CheckpointError(
                f"{path} holds {len(data['sequences'])} responses of {data.get('max_new_tokens')} new tokens, "
                f"but this run asks for {len(prompts)} of {max_new_tokens}; delete it or pass the options it was made with"
            )
        if data.get("prompts") != prompts:
            cached_prompts = data.get("prompts") or [""] * len(prompts)  # data written before prompts were recorded
            differing = [i for i, (a, b) in enumerate(zip(cached_prompts, prompts, strict=True)) if a != b]
            first = differing[0]
            raise CheckpointError(
                f"{path} answers other '{set_name}' prompts than this dflash-train makes ({len(differing)} of "
                f"{len(prompts)} differ; the first is #{first}: {prompts[first][:80]!r}); delete it to generate them anew"
            )
        log(f"reusing {len(data['sequences'])} generated '{set_name}' responses from {path}")
        return data
    log(f"the target answers {len(prompts)} '{set_name}' prompts ({max_new_tokens} tokens each) ...")
    data = generate_data(respond, tokenizer, prompts, max_new_tokens)
    torch.save(data, path)
    return data


def compute_dtype(requested: str) -> torch.dtype:
    """The training's autocast dtype. 'auto': bfloat16 where the CPU has bfloat16 instructions (AVX-512 BF16 or
    AMX), float32 elsewhere. Without them torch's bfloat16 matmul is far slower than its float32 one, measured on 2
    threads for the drafter's LM-head product [960, 576] x [576, 49152]: 63.7 s against 0.82 s forward and backward
    on an AVX2-only AMD EPYC Zen 3, and 1.00 s against 0.23 s forward on an Intel Xeon Ice Lake, which has AVX-512
    but not its BF16 extension (a whole training step there: ~4 s against the 1.13 s of an AMD EPYC Zen 4 with it)."""
    if requested != "auto":
        return getattr(torch, requested)
    chosen = torch.bfloat16 if has_bfloat16_instructions() else torch.float32
    capability = torch.backends.cpu.get_cpu_capability()
    log(f"compute dtype {str(chosen).removeprefix('torch.')} (this CPU's torch kernels: {capability}; bfloat16 "
        f"instructions: {'yes' if chosen == torch.bfloat16 else 'no'})")  # fmt: skip
    return chosen


def has_bfloat16_instructions() -> bool:
    """Whether torch finds AVX-512 BF16 or AMX on this CPU (False where this torch cannot tell)."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def tapping_progress(interval_s: float = 30.0) -> Callable[[int, int], None]:
    """make_examples' progress callback: a log line every interval_s seconds and at the end."""
    last_report = time.perf_counter()

    def report(done: int, total: int) -> None:
        nonlocal last_report
        if done == total or time.perf_counter() - last_report >= interval_s:
            last_report = time.perf_counter()
            log(f"tapped {done}/{total} sequences")

    return report


def save_checkpoint(
    path: Path, drafter: DrafterNetwork, optimizer: torch.optim.Optimizer, generator: torch.Generator, step: int
) -> None:
    """Everything a resumed run needs to continue bit for bit as an uninterrupted one would."""
    partial = path.with_suffix(".partial")
    state = {
        "drafter": drafter.state_dict(),
        "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(),
        "step": step,
    }
    torch.save(state, partial)
    os.replace(partial, path)  # a checkpoint is whole or absent


def training_limits(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Each numeric option's least value (`require_at_least`): checked before the data's generation, which alone can
    take an hour."""
    return {
        "--layers": (args.layers, 1),
        "--taps": (args.taps, 0),
        "--block-size": (args.block_size, 2),
        "--num-prompts": (args.num_prompts, 0),
        "--corpus-tokens": (args.corpus_tokens, 1),
        "--corpus-window": (args.corpus_window, 2),
        "--max-new-tokens": (args.max_new_tokens, 1),
        "--generation-batch": (args.generation_batch, 1),
        "--steps": (args.steps, 1),
        "--sequences-per-step": (args.sequences_per_step, 1),
        "--anchors": (args.anchors, 1),
        "--save-every": (args.save_every, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="target checkpoint dir, hub id, or 'smollm2-135m'")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=2, help="drafter layers")
    parser.add_argument("--taps", type=int, default=0, help="target layers tapped (0: as many as drafter layers)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--mask-token-id", type=int, help="the drafter's mask token (default: a padding row or unused special token)"
    )
    parser.add_argument(
        "--prompt-sets", nargs="+", choices=sorted(PROMPT_SETS), default=["code", "prose"],
        help="built-in prompt sets the target answers (each is generated and cached on its own; default: code prose; "
        "the demo drafter: code and code-puzzles to code-puzzles-6; code-methods added to code drafted "
        "HumanEval no better: see its README)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=0, help="prompts taken from each set (0: all)")
    parser.add_argument(
        "--corpus", nargs="*", choices=sorted(CORPORA), default=[],
        help="real text the target reads (teacher-forced) beside its own answers",
    )  # fmt: skip
    parser.add_argument("--corpus-tokens", type=int, default=262144, help="tokens taken from each corpus")
    parser.add_argument("--corpus-window", type=int, default=512, help="tokens per corpus sequence")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--generation-batch", type=int, default=32, help="prompts answered together (with --generate-with: the engine's slots)"
    )
    parser.add_argument(
        "--generate-with", type=Path, metavar="REPO",
        help="a dflash-build output of this target (float32, --quantize none): its engine answers the prompts, by plain "
        "batched greedy decoding (on a 2-core CPU ~3x torch's rate); default: the target in torch",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--sequences-per-step", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=16, help="random blocks per sequence and step")
    parser.add_argument(
        "--answer-anchors", type=float, default=0.0, metavar="SHARE",
        help="share of each sequence's blocks started inside the target's answer, before its first end-of-turn token "
        "(0: anywhere after the prompt; answers decoded past their end of turn are mostly that filler)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-vocab", type=int, default=0, metavar="N",
        help="train the drafter to draft only token ids below N, as `dflash-build --draft-vocab N` drafts (recorded in "
        "its config as dflash_config.draft_vocab_size, which dflash-build then applies): the LM-head product and "
        "softmax of a step cost N/V of the whole vocabulary's; 0: the whole vocabulary",
    )  # fmt: skip
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="autocast dtype of the training forward/backward (weights and optimizer stay float32); "
        "auto: bfloat16 on CPUs with bfloat16 instructions (AVX-512 BF16 or AMX), float32 elsewhere",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="dtype of the written drafter")
    args = parser.parse_args(argv)
    require_at_least(parser, training_limits(args))
    if args.learning_rate <= 0:
        parser.error(f"--learning-rate {args.learning_rate}: give a positive rate (default 3e-3)")
    if not 0.0 <= args.answer_anchors <= 1.0:
        parser.error(f"--answer-anchors {args.answer_anchors}: give a share between 0 and 1, e.g. 0.75")
    torch.manual_seed(args.seed)
    try:
        target_dir = resolve_checkpoint(args.target)
        target_config = parse_target_config(read_config_json(target_dir))
        try:  # before the answers and taps, which take hours
            check_draft_vocab(args.draft_vocab, target_config.vocab_size)
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        mask_token_id = args.mask_token_id
        if mask_token_id is None:
            mask_token_id = choose_mask_token_id(target_config.vocab_size, tokenizer)
        args.output.mkdir(parents=True, exist_ok=True)
        sequences: list[torch.Tensor] = []
        prompt_lengths: list[int] = []
        if args.generate_with is None:
            respond = torch_responder(target_dir, args.generation_batch)
        else:
            respond = engine_responder(args.generate_with, target_dir, args.generation_batch)
        for set_name in args.prompt_sets:
            data = load_or_generate(args.output, set_name, respond, tokenizer, args.max_new_tokens, args.num_prompts)
            sequences += data["sequences"]
            prompt_lengths += data["prompt_lengths"]
        for corpus in args.corpus:
            windows = corpus_windows(tokenizer, CORPORA[corpus](), args.corpus_window, args.corpus_tokens)
            if not windows:
                message = f"corpus '{corpus}' has no text of {args.corpus_window} tokens; pass a smaller --corpus-window"
                raise CheckpointError(message)
            log(f"corpus '{corpus}': {len(windows)} windows of {args.corpus_window} tokens, read teacher-forced")
            sequences += [torch.tensor(ids) for ids in windows]
            prompt_lengths += [1] * len(windows)  # a block needs some context before its anchor
    except CheckpointError as error:
        print(f"dflash-train: error: {error}", file=sys.stderr)
        return 2
    draft_vocab = 0 if args.draft_vocab == target_config.vocab_size else args.draft_vocab
    config = drafter_config_dict(
        target_config, args.layers, args.block_size, mask_token_id, args.taps or None, draft_vocab=draft_vocab
    )

    drafter = init_drafter(config, seed=args.seed)
    tapped_layers = tuple(parse_drafter_config(config).target_layer_ids)
    target = load_target(target_dir, tapped_layers, torch.float32)
    dtype = compute_dtype(args.compute_dtype)
    taps_path = args.output / "taps.pt"
    tap_settings = (checkpoint_hashes(target_dir), tapped_layers, str(dtype), target_config.eos_token_ids, prompt_lengths)
    fingerprint = examples_fingerprint(tap_settings, sequences)
    examples = load_examples(taps_path, fingerprint)
    if examples is not None:
        log(f"reusing the taps of {len(examples)} training sequences from {taps_path}")
    else:
        log(f"tapping the target over {len(sequences)} training sequences ({sum(len(t) for t in sequences)} tokens) ...")
        examples = make_examples(
            target, sequences, prompt_lengths, taps_dtype=dtype, progress=tapping_progress(), stop_ids=target_config.eos_token_ids
        )
        save_examples(taps_path, examples, fingerprint)
    settings = TrainSettings(
        args.steps, args.learning_rate, args.sequences_per_step, args.anchors, seed=args.seed, compute_dtype=dtype,
        answer_anchor_share=args.answer_anchors, draft_vocab=draft_vocab,
    )  # fmt: skip

    checkpoint_path = args.output / "checkpoint.pt"
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)  # draws the training sequences and anchors
    start = 0
    if checkpoint_path.is_file():
        state = torch.load(checkpoint_path)
        if "generator" not in state:
            message = f"{checkpoint_path} was written without the sampling state that resuming needs; delete it to start over"
            print(f"dflash-train: error: {message}", file=sys.stderr)
            return 2
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        start = int(state["step"])
        log(f"resuming at step {start}")
    began = time.perf_counter()
    history: list[tuple[float, float]] = []

    def on_step(step: int, loss: float, accuracy: float) -> None:
        history.append((loss, accuracy))
        done = step + 1
        if done % 10 == 0 or done == args.steps:
            recent = history[-10:]
            per_step = (time.perf_counter() - began) / len(history)
            filled = 20 * done // args.steps
            log(
                f"[{'#' * filled}{'.' * (20 - filled)}] step {done}/{args.steps}  "
                f"loss {sum(r[0] for r in recent) / len(recent):.3f}  "
                f"slot-1 acc {sum(r[1] for r in recent) / len(recent):.2f}  ETA {per_step * (args.steps - done) / 60:.1f} min"
            )
        if done % args.save_every == 0:
            save_checkpoint(checkpoint_path, drafter, optimizer, generator, done)

    train_drafter(drafter, target, examples, settings, on_step, start, optimizer, generator)
    save_checkpoint(checkpoint_path, drafter, optimizer, generator, args.steps)
    save_drafter(drafter, config, args.output, getattr(torch, args.dtype))
    taps_path.unlink()  # only a resumed run needs them, and they are large (4 bytes x taps x hidden per token)
    log(f"drafter written to {args.output} ({time.perf_counter() - began:.0f} s of training)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
