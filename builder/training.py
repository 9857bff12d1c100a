"""DFlash drafter training (the objective of the DFlash paper, on the inference networks themselves).

Target frozen (embedding and lm_head too). Data: sequences whose responses the target generated itself, and
real text the target reads (teacher-forced). Per sequence, many random anchors a; block = [token_at_a, MASK x
(B-1)] at positions a..a+B-1; a block sees the context strictly before a plus itself. The anchors of one sequence
are the batch rows of one drafter forward over the shared, position-indexed context cache, with ctx_len = a
masking what each block may see (the sparse block mask, expressed by the same code that drafts at inference).

Labels are the target's greedy tokens: slot k of the block at a is trained towards the target's argmax at a+k
given the sequence's tokens before it, and only while that is what greedy decoding from a would have produced,
i.e. while every token a+1..a+k-1 of the sequence is itself the target's argmax (always, in the target's own
responses; in real text, up to the first token the target would not have written). Loss: cross-entropy on those
slots, slot k weighted exp(-(k-1)/gamma).

With a draft vocabulary of N ids (`dflash-build --draft-vocab N`: the drafter proposes only ids below N), the
drafter is trained as it will draft: its logits are the head's first N rows, and a slot is trained only while every
label up to it is below N (a draft can never be a larger id, so greedy verification stops there). The head's
product and the softmax then cost N/V of the whole vocabulary's.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from dflash_trt.builder.networks import DrafterNetwork, TargetNetwork, draft_logits

DEFAULT_GAMMA = {16: 7.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return DEFAULT_GAMMA.get(block_size, block_size / 2)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1]: weight of slot k=1..B-1 is exp(-(k-1)/gamma); early slots matter most for acceptance."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


@torch.no_grad()
def generate_responses(
    target: TargetNetwork, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[torch.Tensor]:
    """The target's own continuations of a batch of prompts of any lengths -> [len(prompt) + max_new_tokens] each.

    All rows step through the same positions: the shortest prompt is prefilled for everyone, then each row is
    fed its own prompt tokens (teacher-forced) until its prompt ends and its own predictions after that. Sort
    prompts by length before batching them so little work is spent past a row's last needed position.
    """
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(p) for p in prompts])  # [N]
    start, end = int(lengths.min()), int(lengths.max()) + max_new_tokens
    tokens = torch.zeros((len(prompts), end), dtype=torch.long)  # [N, end]
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
    cache = target.allocate_cache(len(prompts), end)
    positions = torch.arange(start).expand(len(prompts), -1)
    out = target(tokens[:, :start], positions, cache.past(0), logits_to_keep=1)
    cache.write(positions, out.k, out.v)
    for position in range(start, end):
        logits = out.logits[:, -1].float()  # [N, V]: the prediction for this position
        if temperature > 0:
            predicted = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        else:
            predicted = logits.argmax(-1)
        tokens[:, position] = torch.where(position < lengths, tokens[:, position], predicted)  # prompt rows stay forced
        if position + 1 < end:
            step_positions = torch.full((len(prompts), 1), position)
            out = target(
                tokens[:, position : position + 1], step_positions, cache.past(position), 1, recurrent=out.recurrent
            )  # hybrid targets carry their Gated DeltaNet state from token to token
            cache.write(step_positions, out.k, out.v)
    return [tokens[row, : length + max_new_tokens].clone() for row, length in enumerate(lengths.tolist())]


@dataclass(frozen=True)
class TrainingExample:
    tokens: torch.Tensor  # [L]: prompt + the target's own response, or real text
    taps: torch.Tensor  # [L, n_taps*E]: the drafter's context for every position
    labels: torch.Tensor  # [L]: the target's greedy token for each position given tokens before it ([0]: tokens[0])
    first_anchor: int  # blocks start in the response: anchors >= the prompt length
    answer_end: int  # just past the response's first end-of-turn token (the length where it has none)


@torch.no_grad()
def make_examples(
    target: TargetNetwork,
    sequences: list[torch.Tensor],
    prompt_lengths: list[int],
    batch_size: int = 8,
    taps_dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    stop_ids: tuple[int, ...] = (),
) -> list[TrainingExample]:
    """Tap every position of each sequence and read the target's greedy prediction there; sequences go through
    the target in right-padded batches (causal attention: padding after a sequence cannot change its taps).
    taps_dtype: how the taps are kept (bfloat16 halves their memory and changes nothing for a drafter trained
    under bfloat16 autocast, whose first use of them is a matmul in bfloat16). progress(done, total) after each batch.
    stop_ids: the target's end-of-turn tokens, which end each example's answer (`TrainingExample.answer_end`)."""
    examples = []
    for first in range(0, len(sequences), batch_size):
        batch = sequences[first : first + batch_size]
        longest = max(s.shape[0] for s in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)  # [b, longest]
        for row, tokens in enumerate(batch):
            ids[row, : tokens.shape[0]] = tokens
        positions = torch.arange(longest).expand(len(batch), -1)
        out = target(ids, positions, target.allocate_cache(len(batch), 0).past(0))  # taps [b, longest, n*E]
        predicted = out.logits.argmax(-1)  # [b, longest]: the target's token for position p + 1
        for row, tokens in enumerate(batch):
            length = tokens.shape[0]
            labels = torch.cat([tokens[:1], predicted[row, : length - 1]])  # [L]
            taps = out.taps[row, :length].to(taps_dtype).clone()
            prompt_length = prompt_lengths[first + row]
            end = answer_end(tokens, prompt_length, stop_ids)
            examples.append(TrainingExample(tokens, taps, labels, prompt_length, end))
        if progress is not None:
            progress(len(examples), len(sequences))
    return examples


def examples_fingerprint(settings: tuple[object, ...], sequences: list[torch.Tensor]) -> str:
    """sha256 of what tapping depends on: `settings` (the target's file hashes, tapped layers, dtype, stop tokens,
    prompt lengths; compared by their repr) and every sequence's tokens."""
    digest = hashlib.sha256(repr(settings).encode())
    for tokens in sequences:
        digest.update(tokens.numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def save_examples(path: Path, examples: list[TrainingExample], fingerprint: str) -> None:
    """The tapped examples under their fingerprint, so that a resumed run skips tapping; whole or absent."""
    partial = path.with_suffix(".partial")
    columns = {field.name: [getattr(e, field.name) for e in examples] for field in fields(TrainingExample)}
    torch.save({"fingerprint": fingerprint, **columns}, partial)
    os.replace(partial, path)


def load_examples(path: Path, fingerprint: str) -> list[TrainingExample] | None:
    """save_examples' examples if `path` holds them under this fingerprint (memory-mapped), else None."""
    if not path.is_file():
        return None
    state = torch.load(path, mmap=True, weights_only=True)
    if state["fingerprint"] != fingerprint:
        return None
    columns = [state[field.name] for field in fields(TrainingExample)]
    return [TrainingExample(*row) for row in zip(*columns, strict=True)]


def answer_end(tokens: torch.Tensor, prompt_length: int, stop_ids: tuple[int, ...]) -> int:
    """tokens: [L] -> the position just past the first of `stop_ids` at or after `prompt_length` (L if none)."""
    stops = torch.isin(tokens[prompt_length:], torch.tensor(stop_ids, dtype=tokens.dtype)).nonzero()
    return prompt_length + int(stops[0, 0]) + 1 if stops.numel() else tokens.shape[0]


def sample_anchors(
    generator: torch.Generator, example: TrainingExample, block_size: int, count: int, answer_share: float = 0.0
) -> torch.Tensor:
    """[count] anchor positions a with example.first_anchor <= a and a + B - 1 < length (every label exists); a share
    `answer_share` of them (rounded) inside the answer, before `example.answer_end`, where the target's answer is
    what a server drafts for (the text past an end of turn repeats across answers, and is learnt from few anchors)."""
    length, low = example.tokens.shape[0], example.first_anchor
    high = length - block_size + 1
    if high <= low:
        raise ValueError(f"sequence of {length} tokens is too short for a block of {block_size} after position {low}")
    in_answer = round(count * answer_share) if min(example.answer_end, high) > low else 0
    anywhere = torch.randint(low, high, (count - in_answer,), generator=generator)
    if not in_answer:
        return anywhere
    return torch.cat([torch.randint(low, min(example.answer_end, high), (in_answer,), generator=generator), anywhere])


@dataclass(frozen=True)
class LossTerms:
    loss: torch.Tensor
    accuracy: float  # fraction of slot-1 predictions equal to the label (first-draft-token accuracy)


def dflash_block_loss(
    drafter: DrafterNetwork,
    target: TargetNetwork,
    tokens: torch.Tensor,
    taps: torch.Tensor,
    labels: torch.Tensor,
    anchors: torch.Tensor,
    weights: torch.Tensor,
    vocab: int = 0,
) -> LossTerms:
    """tokens, labels: [L], taps: [L, n*E], anchors: [K] -> position-weighted CE over the K blocks of one sequence,
    drafting from the first `vocab` token ids (0: all)."""
    size, count = drafter.config.block_size, anchors.shape[0]
    hidden, positions = draft_blocks(drafter, target, tokens, taps, anchors)  # [K, B, E], [K, B]
    slot_labels = labels[positions[:, 1:]]  # [K, B-1]: slot j predicts the target's token at its own position
    trained = greedy_slots(tokens, labels, anchors, size)  # [K, B-1]
    if vocab:
        trained &= (slot_labels < vocab).long().cumprod(-1).bool()  # no draft reaches past a label it cannot propose
    head = draft_head(target, vocab)  # [V', E]
    logits = draft_logits(hidden[:, 1:][trained], head, drafter.config)  # [N, V']: trained slots only
    targets = slot_labels[trained]  # [N]
    per_slot = F.cross_entropy(logits.float(), targets, reduction="none")  # [N]
    slot_weight = weights.expand(count, -1)[trained]  # [N]
    loss = (per_slot * slot_weight).sum() / (count * weights.sum())  # an untrained slot adds nothing
    first_trained = trained[:, 0]  # [K]: slot 1 is untrained only where its label is outside the draft vocabulary
    first_slot = trained.flatten().cumsum(0).view(count, -1)[first_trained, 0] - 1  # each such block's slot 1 among the N
    hits = logits[first_slot].argmax(-1) == targets[first_slot]  # a block whose slot 1 cannot be drafted is a miss
    accuracy = hits.float().sum().item() / count
    return LossTerms(loss, accuracy)


def draft_head(target: TargetNetwork, vocab: int = 0) -> torch.Tensor:
    """[V', E]: the rows of the target's LM head that the drafter drafts from, the first `vocab` (0: all)."""
    head = target.lm_head.weight
    return head[:vocab] if vocab else head


def draft_blocks(
    drafter: DrafterNetwork,
    target: TargetNetwork,
    tokens: torch.Tensor,
    taps: torch.Tensor,
    anchors: torch.Tensor,
    slots: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens: [L], taps: [L, n*E], anchors: [K] -> (hidden [K, S, E], positions [K, S]): one drafter forward over
    the blocks [token_at_a, MASK x (S-1)], each seeing the context strictly before its anchor. S = `slots`, the
    whole block by default (a step using k drafts denoises S = 1 + k, as the engine's graphs do)."""
    size, count = slots or drafter.config.block_size, anchors.shape[0]
    ctx_k, ctx_v = drafter.context_kv(taps[None], torch.arange(tokens.shape[0])[None])  # [Ld, 1, L, Hkv, D]
    positions = anchors[:, None] + torch.arange(size)  # [K, B]
    block = torch.full((count, size), drafter.config.mask_token_id, dtype=torch.long)
    block[:, 0] = tokens[anchors]
    with torch.no_grad():
        embeds = target.embed_tokens(block) * drafter.config.input_embedding_scale  # [K, B, E]
    ctx_k, ctx_v = ctx_k.expand(-1, count, -1, -1, -1), ctx_v.expand(-1, count, -1, -1, -1)  # shared by all K blocks
    return drafter(embeds, positions, ctx_k, ctx_v, anchors), positions  # block k sees context positions < anchor k


def greedy_slots(tokens: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """tokens, labels: [L], anchors: [K] -> [K, B-1] bool: slot k of the block at a is trained while greedy
    decoding from a would reach it, i.e. while tokens a+1..a+k-1 all equal the target's greedy labels."""
    agrees = tokens == labels  # [L]
    inner = anchors[:, None] + torch.arange(1, block_size - 1)  # [K, B-2]: positions a+1..a+B-2
    reached = agrees[inner].long().cumprod(-1).bool()  # [K, B-2]
    return torch.cat([torch.ones_like(reached[:, :1]), reached], dim=-1)


@torch.no_grad()
def greedy_acceptance(
    drafter: DrafterNetwork,
    target: TargetNetwork,
    example: TrainingExample,
    anchors: torch.Tensor,
    slots: int | None = None,
    vocab: int = 0,
) -> torch.Tensor:
    """anchors: [K] with a + B - 1 < L -> [K]: how many drafts of the block at each anchor greedy verification
    accepts (leading slots whose draft argmax is the target's greedy token; the sequence must be the target's own
    greedy answer from the anchors on), the drafter denoising `slots` block slots (default: all) and drafting from
    the first `vocab` token ids (0: all)."""
    hidden, positions = draft_blocks(drafter, target, example.tokens, example.taps, anchors, slots)  # [K, S, E], [K, S]
    drafts = draft_logits(hidden[:, 1:], draft_head(target, vocab), drafter.config).argmax(-1)  # [K, S-1]
    matches = drafts == example.labels[positions[:, 1:]]
    return matches.long().cumprod(-1).sum(-1)


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    learning_rate: float = 3e-3
    sequences_per_step: int = 4
    anchors_per_sequence: int = 16
    gamma: float | None = None
    warmup_steps: int = 20
    seed: int = 0
    answer_anchor_share: float = 0.0  # share of each sequence's anchors drawn inside its answer (see sample_anchors)
    compute_dtype: torch.dtype = torch.bfloat16  # autocast for forward/backward; master weights stay float32
    draft_vocab: int = 0  # the drafter drafts from the first draft_vocab token ids (0: all; see the module's doc)


def train_drafter(
    drafter: DrafterNetwork,
    target: TargetNetwork,
    examples: list[TrainingExample],
    settings: TrainSettings,
    on_step: Callable[[int, float, float], None] | None = None,
    start_step: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    generator: torch.Generator | None = None,
) -> torch.optim.Optimizer:
    """Train the drafter in place; calls on_step(step, loss, slot-1 accuracy) after each step. Resumes from
    start_step; a resumed run equals an uninterrupted one when `generator` (which draws the sequences and anchors;
    default: seeded from settings.seed) is in the state it had after step start_step - 1."""
    for param in target.parameters():
        param.requires_grad_(False)
    size = drafter.config.block_size
    usable = [e for e in examples if e.tokens.shape[0] - size + 1 > e.first_anchor]
    if not usable:
        raise ValueError(f"no training sequence is long enough for a block of {size} after its prompt; generate longer responses")
    weights = slot_weights(size, settings.gamma or default_gamma(size))
    if generator is None:
        generator = torch.Generator().manual_seed(settings.seed)
    optimizer = optimizer or torch.optim.AdamW(drafter.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    autocast = torch.autocast(
        usable[0].taps.device.type, dtype=settings.compute_dtype, enabled=settings.compute_dtype != torch.float32
    )
    drafter.train()
    for step in range(start_step, settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = _cosine_lr(step, settings)
        chosen = [usable[i] for i in torch.randint(0, len(usable), (settings.sequences_per_step,), generator=generator).tolist()]
        with autocast:
            terms = [
                dflash_block_loss(
                    drafter, target, e.tokens, e.taps, e.labels,
                    sample_anchors(generator, e, size, settings.anchors_per_sequence, settings.answer_anchor_share), weights,
                    settings.draft_vocab,
                )
                for e in chosen
            ]  # fmt: skip
        loss = torch.stack([t.loss for t in terms]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        if on_step is not None:
            on_step(step, loss.item(), sum(t.accuracy for t in terms) / len(terms))
    drafter.eval()
    return optimizer


def _cosine_lr(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))
