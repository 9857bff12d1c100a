"""How well drafters follow the target on benchmark prompts, without building an engine (torch, CPU or GPU).

The target answers each prompt greedily (chat template, --max-tokens new tokens); every drafter then drafts a
block at every position of those answers. Printed per drafter, as one JSON line:
- tau_full_block: mean tokens per step of a greedy loop that verifies the whole block every step (what
  `dflash-bench --verify full` measures on the engine, up to kernel rounding);
- per_anchor: mean accepted drafts + 1 over every anchor of the answers (smoother than tau, same scale);
- slot_acceptance: fraction of anchors whose first k drafts are all accepted, k = 1..4.

With --block-slots S the drafter denoises only the first S block slots, as an engine step that uses S - 1 drafts
does (so tau_full_block then means S tokens at most per step):

    python scripts/drafter_acceptance.py --drafter builder/drafters/smollm2-135m-dflash /tmp/new \\
        --dataset humaneval --num-prompts 20 --max-tokens 128 [--block-slots 3]

Each drafter drafts from its own draft vocabulary (dflash_config.draft_vocab_size, as `dflash-build` cuts it) or
from the first --draft-vocab N ids (as `dflash-build --draft-vocab N`); 0: the whole vocabulary.

With --answers DATA (a `dflash-train` data file, OUTPUT/data-SET.pt) the drafters draft over --num-prompts of
the target's answers cached there (evenly spread over the file, which is sorted by prompt length) instead: a
prompt set one drafter trained on and another did not tells memorising from a gap between training prompts and
a benchmark's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from dflash_trt.builder.models import resolve_checkpoint
from dflash_trt.builder.networks import load_drafter, load_target
from dflash_trt.builder.training import generate_responses, greedy_acceptance, make_examples
from dflash_trt.runtime.prompts import dataset_prompts, encode_prompt
from transformers import AutoTokenizer


def loop_tau(accepted: torch.Tensor, first_anchor: int) -> list[int]:
    """accepted: [L - B + 1] accepted drafts at every anchor -> tokens per step of the whole-block greedy loop."""
    steps, anchor = [], first_anchor
    while anchor < accepted.shape[0]:
        steps.append(int(accepted[anchor]) + 1)
        anchor += steps[-1]
    return steps


def benchmark_answers(target_dir: Path, dataset: str, num_prompts: int, max_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """The target's greedy answers to a benchmark's prompts through its chat template, and the prompts' lengths."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [encode_prompt(tokenizer, text) for text in dataset_prompts(dataset, num_prompts)]
    plain = load_target(target_dir, dtype=torch.float32)
    return generate_responses(plain, prompts, max_tokens), [len(p) for p in prompts]  # batched: as one at a time


def cached_answers(path: Path, count: int) -> tuple[list[torch.Tensor], list[int]]:
    """`count` answers of a dflash-train data file, evenly spread over it, and their prompts' lengths."""
    data = torch.load(path)
    total = len(data["sequences"])
    picked = [index * total // count for index in range(min(count, total))]
    return [data["sequences"][i] for i in picked], [data["prompt_lengths"][i] for i in picked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", nargs="+", type=Path, required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dataset", default="humaneval", help="as dflash-bench's (e.g. humaneval@20: HumanEval/20 on)")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-slots", type=int, help="block slots the drafter denoises (default: its block size)")
    parser.add_argument("--answers", type=Path, help="a dflash-train data file (data-SET.pt) instead of --dataset")
    parser.add_argument("--draft-vocab", type=int, help="draft only ids below N (default: each drafter's own, else all)")
    args = parser.parse_args()
    target_dir = resolve_checkpoint(args.target)
    if args.answers is None:
        answers, prompt_lengths = benchmark_answers(target_dir, args.dataset, args.num_prompts, args.max_tokens)
    else:
        answers, prompt_lengths = cached_answers(args.answers, args.num_prompts)
    for drafter_dir in args.drafter:
        drafter = load_drafter(drafter_dir, torch.float32)
        target = load_target(target_dir, tuple(drafter.config.target_layer_ids), torch.float32)
        examples = make_examples(target, answers, prompt_lengths)
        size = drafter.config.block_size
        vocab = drafter.config.draft_vocab_size if args.draft_vocab is None else args.draft_vocab
        per_anchor, steps, slot_hits = [], [], torch.zeros(4)
        for example in examples:
            anchors = torch.arange(example.tokens.shape[0] - size + 1)
            accepted = greedy_acceptance(drafter, target, example, anchors, args.block_slots, vocab)  # [L - B + 1]
            in_answer = accepted[example.first_anchor :]
            per_anchor += (in_answer + 1).tolist()
            slot_hits += torch.stack([(in_answer >= k).sum() for k in range(1, 5)]).float()
            steps += loop_tau(accepted, example.first_anchor)
        print(json.dumps({
            "drafter": str(drafter_dir), "dataset": str(args.answers or args.dataset), "prompts": len(answers),
            "max_tokens": max(len(a) - n for a, n in zip(answers, prompt_lengths, strict=True)),
            "block_slots": args.block_slots or size, "draft_vocab": vocab or drafter.config.vocab_size,
            "tau_full_block": round(sum(steps) / len(steps), 3), "per_anchor": round(sum(per_anchor) / len(per_anchor), 3),
            "slot_acceptance": [round(float(h) / len(per_anchor), 3) for h in slot_hits],
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
