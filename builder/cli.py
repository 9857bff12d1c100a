"""dflash-build: a target and its DFlash drafter -> engines -> a ready Triton model repository."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from dflash_trt.builder.calibration import LinearInputs, calibration_windows, collect_linear_inputs
from dflash_trt.builder.checkpoints import (
    CheckpointError,
    DrafterConfig,
    TargetConfig,
    check_pair,
    parse_drafter_config,
    parse_target_config,
    require_buildable,
    skipped_weights,
)
from dflash_trt.builder.draft_vocab import check_draft_vocab
from dflash_trt.builder.drafter_init import drafter_config_dict, untrained_drafter_dir
from dflash_trt.builder.export import package_exported
from dflash_trt.builder.export_cache import ExportCache, cached_export, key_record
from dflash_trt.builder.graphs import DFlashGraphs, engine_spec
from dflash_trt.builder.models import ALIASES, looks_like_hub_id, pair_configs, resolve_pair
from dflash_trt.builder.networks import DrafterNetwork, TargetNetwork, load_pair
from dflash_trt.builder.parallel_export import export_engines_onnx
from dflash_trt.builder.parallel_plan import (
    UNTESTED_TP_NOTE,
    Parallelism,
    check_parallelism,
    describe_ranks,
    rank_plan,
    smallest_tp,
)
from dflash_trt.builder.plan import describe, memory_plan, parse_bytes
from dflash_trt.builder.quantize import QuantizationMode, check_mode, manifest_record
from dflash_trt.builder.repository import (
    ENGINE_DIR,
    TOKENIZER_DIR,
    checkpoint_hashes,
    copy_tokenizer,
    link_checkpoint,
    staged_output,
    write_manifest,
    write_templates,
)
from dflash_trt.builder.tensorrt_engine import TensorRTUnavailable, build_plan, require_tensorrt, tensorrt_available
from dflash_trt.builder.trtllm_args import TRTLLM_CONTAINER, TRTLLM_RELEASE
from dflash_trt.builder.trtllm_repository import DYNAMO_IMAGE, ServedPair, llm_args, write_trtllm_repository
from dflash_trt.runtime.graph_io import GRAPH_SCHEMA
from dflash_trt.runtime.onnxruntime_runner import SessionSettings
from dflash_trt.runtime.options import require_at_least
from dflash_trt.runtime.repository import SERVABLE, TORCH_ENGINE_DIRS
from dflash_trt.runtime.scheduler import LOOKUP_LIMIT, PREFILL_CHUNK
from transformers import AutoTokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SEQ_LEN = 2048
EXPORT_CACHE_ENV = "DFLASH_TRT_EXPORT_CACHE"  # the default of --export-cache
TRTLLM_GPU_MEMORY = "141GB"  # --backend trtllm without --gpu-memory: one H200


def choose_backend(requested: str) -> str:
    """`auto` picks only a backend whose serving has been verified: torch-cuda on a GPU (its code path, on the
    CPU), ONNX Runtime on the CPU. TensorRT plans are built when asked for: their runner has never run."""
    if requested != "auto":
        return requested
    if tensorrt_available() and torch.cuda.is_available():
        print(
            "[dflash-build] TensorRT and a GPU are here, but the TensorRT runner has never been run: building "
            "torch-cuda engines (--backend tensorrt builds plans)",
            file=sys.stderr,
        )
    return "torch-cuda" if torch.cuda.is_available() else "onnxruntime"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dflash-build", description=__doc__)
    parser.add_argument(
        "--model", required=True, help=f"target: a checkpoint dir, a hub id, 'smollm2-135m', or an alias ({', '.join(ALIASES)})"
    )
    parser.add_argument(
        "--drafter", help="z-lab DFlash drafter dir or hub id (aliases name their own; default: an untrained drafter)"
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "onnxruntime", "torch-cuda", "tensorrt", "trtllm"),
        default="auto",
        help="onnxruntime: CPU engines; torch-cuda: the pair's checkpoints run by torch on a GPU; tensorrt: plans "
        "for the TensorRT runner (written against TensorRT's API, never run: untested); trtllm: a repository for "
        "TensorRT-LLM's PyTorch engine on one or more GPUs "
        f"(--tp/--pp/--ep; configs only, nothing downloaded; TensorRT-LLM {TRTLLM_RELEASE}); auto: torch-cuda where "
        "CUDA is, else onnxruntime",
    )
    parser.add_argument("--tp", type=int, default=1, help="--backend trtllm: tensor-parallel GPUs")
    parser.add_argument("--pp", type=int, default=1, help="--backend trtllm: pipeline-parallel stages")
    parser.add_argument("--ep", type=int, default=1, help="--backend trtllm: expert-parallel groups (MoE targets; divides --tp)")
    parser.add_argument(
        "--dynamo-image", default=DYNAMO_IMAGE, help="--backend trtllm: the image of the Dynamo deployment it writes"
    )
    parser.add_argument("--block-size", type=int, help="draft block size (default: the drafter's)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help=f"prompt + generated tokens per sequence (default {DEFAULT_MAX_SEQ_LEN}, or less if the target has fewer positions)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="engine precision (auto: float32 on CPU, the checkpoint's on GPU)",
    )
    parser.add_argument(
        "--quantize",
        default="none",
        metavar="MODE",
        help="weight quantization of the linear layers: none | int8 | int4 (ONNX Runtime, MatMulNBits) | fp8 | int4-awq "
        "(TensorRT's Q/DQ forms, calibrated on the toolkit's sources; ONNX Runtime runs them too, to check them, not "
        "fast); docs/quantization.md has the policy and measured quality",
    )
    parser.add_argument(
        "--quantize-drafter",
        metavar="MODE",
        help="the drafter's side on its own (its layers, tap projection and LM-head copy): none | int8 | int4; drafts "
        "are verified, so this changes acceptance and speed, never output (default: as --quantize)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        metavar="N",
        help="the drafter proposes only token ids below N: its LM head cut to the first N rows, a cheaper draft (the "
        "target verifies every token, so output never changes; byte-level BPE ids run roughly by frequency); 0: the "
        "whole vocabulary, or the drafter's own draft_vocab_size if dflash-train gave it one (then at most that). "
        "ONNX engines (onnxruntime, tensorrt)",
    )
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: one per core)")
    parser.add_argument("--no-chat-template", action="store_true", help="serve raw prompts instead of chat-templated ones")
    parser.add_argument("--output", type=Path, help="model repository directory to write")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    parser.add_argument(
        "--export-cache",
        type=Path,
        default=os.environ.get(EXPORT_CACHE_ENV) or None,
        metavar="DIR",
        help="keep the float ONNX graphs here and reuse them when the same checkpoints, block size, --max-seq-len and "
        "dtype are built again by this version (to try --quantize modes or another --max-batch-size without tracing "
        f"again); default: ${EXPORT_CACHE_ENV}, else no cache",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what the pair costs (weights, state per token and per sequence) from its configs alone, build nothing",
    )
    parser.add_argument(
        "--gpu-memory",
        help="with --plan: how many sequences of --max-seq-len fit in this much (e.g. 141GB); --backend trtllm: one "
        f"GPU's memory, which sizes the KV cache (default {TRTLLM_GPU_MEMORY})",
    )
    args = parser.parse_args(argv)
    require_at_least(parser, {"--threads": (args.threads, 0)})  # 0: one per core
    if args.backend != "trtllm" and (args.tp, args.pp, args.ep) != (1, 1, 1):
        parser.error(f"--tp/--pp/--ep shard TensorRT-LLM engines: add --backend trtllm (got --backend {args.backend})")
    if args.output is None and not args.plan:
        parser.error("--output is required (or pass --plan to print the memory plan without building)")
    return args


def _configs(args: argparse.Namespace) -> tuple[TargetConfig, DrafterConfig | None]:
    """Both configs, read before any weight is fetched; the pair is checked when a drafter is named. --backend trtllm
    reads an alias's shipped configs where the hub cache has none (it never downloads weights)."""
    target_raw, drafter_raw = pair_configs(args.model, args.drafter, shipped=args.backend == "trtllm")
    target = parse_target_config(target_raw, where=args.model)
    if drafter_raw is None:
        return target, None
    drafter = parse_drafter_config(drafter_raw, where=args.drafter or f"{args.model}'s drafter")
    check_pair(target, drafter)
    return target, drafter


def print_plan(args: argparse.Namespace, target: TargetConfig, drafter: DrafterConfig | None, block: int, backend: str) -> None:
    drafter = drafter or parse_drafter_config(drafter_config_dict(target, mask_token_id=0))  # an untrained one
    dtype = args.dtype if args.dtype != "auto" else str(target.dtype).removeprefix("torch.")
    memory = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    quantization = check_mode(args.quantize, backend)
    plan = memory_plan(target, drafter, dtype, args.max_seq_len, block, quantization)
    print(f"[dflash-build] plan for {args.model} (block {block}, --max-seq-len {args.max_seq_len}):")
    print(describe(plan, dtype, args.max_seq_len, memory, quantization.name))


def calibrate(
    target: TargetNetwork,
    drafter: DrafterNetwork,
    tokenizer_dir: Path,
    block_size: int,
    modes: tuple[QuantizationMode, QuantizationMode],
) -> dict[str, LinearInputs] | None:
    """The linear layers' input statistics, where a mode is one of TensorRT's calibrated Q/DQ forms."""
    if all(mode.form != "qdq" for mode in modes):
        return None
    windows = calibration_windows(AutoTokenizer.from_pretrained(tokenizer_dir))
    names = "/".join(sorted({mode.name for mode in modes if mode.form == "qdq"}))
    print(f"[dflash-build] calibrating {names} on {len(windows)} windows of the toolkit's own sources ...", file=sys.stderr)
    return collect_linear_inputs(target, drafter, windows, block_size)


def _draft_vocab(draft_vocab: int, vocab_size: int, backend: str, trained_vocab: int = 0) -> int:
    """The ids to cut the drafter's LM head to; 0: nothing to cut (--draft-vocab 0, or the whole vocabulary).
    trained_vocab: the drafter's dflash_config.draft_vocab_size (0: none), the default and the most allowed."""
    check_draft_vocab(draft_vocab, vocab_size)
    if trained_vocab and draft_vocab > trained_vocab:
        raise ValueError(
            f"--draft-vocab {draft_vocab}: the drafter was trained to draft only ids below {trained_vocab} (its "
            f"dflash_config.draft_vocab_size) and never learnt the others; pass {trained_vocab} or less, or leave it out"
        )
    if backend == "torch-cuda":
        _build_uncut(draft_vocab, trained_vocab, "torch-cuda")
        return 0
    draft_vocab = draft_vocab or trained_vocab
    return 0 if draft_vocab == vocab_size else draft_vocab


def _build_uncut(draft_vocab: int, trained_vocab: int, runner: str) -> None:
    """Where `runner` runs the checkpoints as they are, no head is cut: --draft-vocab is refused, and a drafter trained
    with a draft vocabulary is built whole with a warning (it may draft ids it never learnt: output stays exact,
    acceptance may fall)."""
    if draft_vocab:
        raise ValueError(
            "--draft-vocab cuts the drafter's LM head in ONNX engines (--backend onnxruntime or tensorrt); "
            f"{runner} runs the checkpoints as they are"
        )
    if trained_vocab:
        print(
            f"[dflash-build] warning: the drafter was trained to draft only ids below {trained_vocab} (its "
            f"dflash_config.draft_vocab_size), but {runner} runs the checkpoints as they are: it drafts from the whole "
            "vocabulary here, including ids it never learnt (output is unchanged; acceptance may be lower than with "
            "--backend onnxruntime)",
            file=sys.stderr,
        )


def _check_limits(args: argparse.Namespace, block_size: int, max_positions: int) -> None:
    if not 2 <= block_size <= 64:
        raise ValueError(f"--block-size {block_size} must be in [2, 64]")
    if not 1 <= args.max_batch_size <= 1024:
        raise ValueError(f"--max-batch-size {args.max_batch_size} must be in [1, 1024]")
    if not block_size < args.max_seq_len <= max_positions - block_size:
        raise ValueError(
            f"--max-seq-len {args.max_seq_len} must be in ({block_size}, {max_positions - block_size}] for this target"
        )


def build(args: argparse.Namespace) -> Path | None:
    """Build the repository (None with --plan: the plan is printed, nothing is written or downloaded)."""
    target_config, drafter_config = _configs(args)
    block = args.block_size or (drafter_config.block_size if drafter_config else 16)  # an untrained drafter's: 16
    if args.max_seq_len is None:
        args.max_seq_len = min(DEFAULT_MAX_SEQ_LEN, target_config.max_position_embeddings - block)
        print(f"[dflash-build] --max-seq-len {args.max_seq_len}", file=sys.stderr)
    if args.backend == "trtllm":
        return build_trtllm(args, target_config, drafter_config, block)
    _check_limits(args, block, target_config.max_position_embeddings)  # before --plan: no plan of a refused build
    backend = choose_backend(args.backend)
    trained_vocab = drafter_config.draft_vocab_size if drafter_config else 0
    draft_vocab = _draft_vocab(args.draft_vocab, target_config.vocab_size, backend, trained_vocab)
    if args.plan:
        print_plan(args, target_config, drafter_config, block, backend)
        return None
    require_buildable(target_config, args.model)
    quantization = check_mode(args.quantize, backend)
    drafter_quantization = check_mode(args.quantize_drafter or args.quantize, backend, "--quantize-drafter")
    if backend == "tensorrt":
        require_tensorrt()
    target_dir, drafter_dir = resolve_pair(args.model, args.drafter)
    if drafter_dir is None:
        print(
            "[dflash-build] no --drafter: building with an untrained drafter (tau ~1); train one with dflash-train",
            file=sys.stderr,
        )
        drafter_dir = untrained_drafter_dir(target_dir, AutoTokenizer.from_pretrained(target_dir), block)
    dtype = DTYPES.get(args.dtype, torch.float32 if backend == "onnxruntime" else None)
    print(f"[dflash-build] loading {target_dir} and {drafter_dir} ...", file=sys.stderr)
    target, drafter = load_pair(target_dir, drafter_dir, dtype)
    spec = engine_spec(target, drafter, block, args.max_seq_len, args.max_batch_size)
    settings = SessionSettings(intra_op_threads=args.threads)
    values = {
        "engine_dir": ENGINE_DIR,
        "tokenizer_dir": TOKENIZER_DIR,
        "apply_chat_template": "false" if args.no_chat_template else "true",
        "max_batch_size": str(spec.max_batch_size),
        "engine_model": "dflash",
        "prefill_chunk_tokens": str(PREFILL_CHUNK),
        "lookup_drafts": str(LOOKUP_LIMIT),
    }
    print("[dflash-build] hashing source checkpoints ...", file=sys.stderr)
    hashes = {"target": checkpoint_hashes(target_dir), "drafter": checkpoint_hashes(drafter_dir)}
    with staged_output(args.output, args.force) as repo:
        write_templates(repo, values)
        copy_tokenizer(target_dir, repo)
        engine_dir = repo / "dflash" / "1" / ENGINE_DIR
        engine_dir.mkdir(parents=True)
        if backend == "torch-cuda":  # the same graphs, run by torch at serving time: the checkpoints are the engine
            for name, source in zip(TORCH_ENGINE_DIRS, (target_dir, drafter_dir), strict=True):
                link_checkpoint(source, engine_dir / name)
            paths = []
        else:
            graphs = DFlashGraphs(target, drafter, block, spec.positions).eval()
            modes = (quantization, drafter_quantization)
            calibration = calibrate(target, drafter, repo / TOKENIZER_DIR, block, modes)
            if args.export_cache is None:
                paths = export_engines_onnx(graphs, spec, engine_dir, *modes, calibration, draft_vocab)
            else:  # the float graphs through the cache, then quantized (draft head cut) and packaged from there
                record = key_record(spec, hashes["target"], hashes["drafter"])
                exported = cached_export(ExportCache(args.export_cache), record, partial(export_engines_onnx, graphs, spec))
                paths = package_exported(exported, engine_dir, *modes, calibration, draft_vocab)
        if backend == "tensorrt":
            for path in paths:
                build_plan(path, path.with_suffix(".plan"), path.stem, spec)
        write_manifest(repo, {
            "backend": backend,
            "device": SERVABLE.get(backend, "cuda"),
            "engine": spec.to_json(),
            "graph_schema": GRAPH_SCHEMA,
            "session": asdict(settings),
            "quantization": manifest_record(quantization, drafter_quantization),
            "tap_layer_ids": list(drafter.config.target_layer_ids),
            "eos_token_ids": list(target.config.eos_token_ids),
            "target": {"source": str(target_dir), "type": target.config.model_type, "sha256": hashes["target"],
                       "not_built": skipped_weights(target_dir)},
            "drafter": {"source": str(drafter_dir), "sha256": hashes["drafter"], "vocab": draft_vocab or spec.vocab_size},
        })  # fmt: skip
    return args.output


def build_trtllm(args: argparse.Namespace, target: TargetConfig, drafter: DrafterConfig | None, block: int) -> Path | None:
    """--backend trtllm: plan the ranks, then (without --plan) write the TensorRT-LLM repository."""
    if args.quantize != "none" or args.quantize_drafter:
        raise ValueError(
            "--quantize/--quantize-drafter quantize this toolkit's own engines; TensorRT-LLM loads quantized weights "
            "from the checkpoint: pass a quantized checkpoint (e.g. an FP8 one) as --model"
        )
    _build_uncut(args.draft_vocab, drafter.draft_vocab_size if drafter else 0, "TensorRT-LLM")
    parallel = Parallelism(args.tp, args.pp, args.ep)
    check_parallelism(target, parallel)
    alias = ALIASES.get(args.model.lower())
    drafter_spec = args.drafter or (alias.drafter if alias else None)
    if drafter_spec is None:
        raise ValueError("--backend trtllm needs a trained DFlash drafter: pass --drafter (a hub id or a path in the container)")
    dtype = args.dtype if args.dtype != "auto" else str(target.dtype).removeprefix("torch.")
    memory = parse_bytes(args.gpu_memory or TRTLLM_GPU_MEMORY)
    plan = rank_plan(target, drafter, dtype, args.max_seq_len, block, parallel)
    smallest = smallest_tp(target, drafter, dtype, args.max_seq_len, block, memory, args.max_batch_size)
    print(f"[dflash-build] plan for {args.model} on TensorRT-LLM (block {block}, --max-seq-len {args.max_seq_len}):")
    print(describe_ranks(plan, dtype, args.max_seq_len, memory, smallest, args.max_batch_size))
    if parallel.tp > 1:
        print(f"[dflash-build] note: {UNTESTED_TP_NOTE}", file=sys.stderr)
    if args.plan:
        return None
    fraction = plan.kv_cache_fraction(memory, args.max_batch_size)
    name = args.model if alias or looks_like_hub_id(args.model) else Path(args.model).expanduser().resolve().name
    pair = ServedPair(model=alias.target if alias else args.model, drafter=drafter_spec, name=name)
    llm = llm_args(pair, parallel, block, args.max_batch_size, args.max_seq_len, fraction)
    manifest = {
        "backend": "trtllm",
        "device": "cuda",
        "tensorrt_llm": {"release": TRTLLM_RELEASE, "container": TRTLLM_CONTAINER},
        "parallel": {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "gpus": parallel.gpus},
        "plan": {"gpu_memory": memory, "weight_bytes_per_rank": plan.weight_bytes,
                 "bytes_per_sequence_per_rank": plan.state.bytes_per_sequence, "kv_cache_fraction": fraction},
        "target": {"source": pair.model, "type": target.model_type},
        "drafter": {"source": drafter_spec, "config_read": drafter is not None},
    }  # fmt: skip
    with staged_output(args.output, args.force) as repo:
        write_trtllm_repository(repo, pair, parallel, llm, args.max_batch_size, args.dynamo_image, manifest)
    print(
        f"[dflash-build] for TensorRT-LLM {TRTLLM_RELEASE} on {parallel.gpus} GPU(s): run {args.output}/launch.sh inside "
        f"{TRTLLM_CONTAINER} (TensorRT-LLM has not run here: it cannot be installed on this machine)",
        file=sys.stderr,
    )
    return args.output


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        build(args)
    except (CheckpointError, TensorRTUnavailable, FileExistsError, ValueError) as error:
        print(f"dflash-build: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-build: interrupted; nothing was written to --output", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
