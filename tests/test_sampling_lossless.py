"""Sampling through DFlash is distributed exactly as the target's own sampling (chi-square).

The first generated token comes from prefill and the second is the target's sample at the first verify slot,
so acceptance first matters for the third token: the test compares the joint law of the first three tokens
(which includes that of the first two). The samples are served by the scheduler in batches of `SLOTS` (a seeded row's
output equals the same request served alone: tests/test_batching.py), their identical prompts prefilled in one call
per admission (tests/test_prefixes.py): one run 11.5 s, against 70 s with a prefill call per sample (session 34)."""

from __future__ import annotations

from pathlib import Path

import dflash_trt.builder.graphs as graphs
import numpy as np
import pytest
import torch
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.networks import load_drafter, load_target
from dflash_trt.builder.tiny_checkpoints import peak_weights, write_tiny_drafter
from dflash_trt.runtime.engine import GraphEngine
from dflash_trt.runtime.loop import Sequence
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.scheduler import Scheduler
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3_5TextConfig, Qwen3Config
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

VOCAB = 4
NEW_TOKENS = 3
SAMPLES = 5000
SLOTS = 64
PROMPT = [1, 3, 2, 0, 3]


SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    eos_token_id=None,
    pad_token_id=None,
)


def _pair(root: Path, config: PretrainedConfig, seed: int) -> tuple[Path, GraphEngine]:
    """A random tiny-vocabulary target (peaked weights; norms and Gated DeltaNet decays left alone), a random
    drafter, and their torch engine with block size 4 and `SLOTS` slots."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    peak_weights(model, 0.3)
    model.save_pretrained(root / "target")
    drafter = load_drafter(write_tiny_drafter(root / "target", root / "drafter"))
    target = load_target(root / "target", drafter.config.target_layer_ids)
    engine = torch_engine(target, drafter, 32, block_size=4, max_batch=SLOTS)
    return root / "target", engine


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GraphEngine]:
    return _pair(tmp_path_factory.mktemp("tiny-vocab"), Qwen3Config(**SHARED, bos_token_id=0), seed=4)


@pytest.fixture(scope="module")
def tiny_vocab_hybrid_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GraphEngine]:
    """The same with a qwen3_5 (text-only layout) target: Gated DeltaNet layers, whose state the step rolls back."""
    linear = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    config = Qwen3_5TextConfig(**SHARED, **linear, full_attention_interval=2)
    return _pair(tmp_path_factory.mktemp("tiny-vocab-hybrid"), config, seed=6)


def _target_distribution(target_dir: Path, sampling: SamplingParams) -> np.ndarray:
    """[V, V, V] exact probabilities of the first three tokens under the target's own (HF-warped) sampling."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    warpers = [TemperatureLogitsWarper(sampling.temperature)]
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))

    def next_probs(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[:, -1].double()
        for warp in warpers:
            scores = warp(torch.tensor([ids]), scores)
        return torch.softmax(scores, -1)[0].numpy()

    first = next_probs(PROMPT)
    return np.stack(
        [
            np.stack([first[a] * second * next_probs(PROMPT + [a, b]) for b, second in enumerate(next_probs(PROMPT + [a]))])
            for a in range(VOCAB)
        ]
    )


def _dflash_counts(engine: GraphEngine, sampling: SamplingParams) -> tuple[np.ndarray, int]:
    """Counts of the first three tokens over `SAMPLES` seeds, and how many drafted tokens were accepted."""
    scheduler = Scheduler(engine)
    samples = [
        Sequence(list(PROMPT), NEW_TOKENS, SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed))
        for seed in range(SAMPLES)
    ]
    for sample in samples:
        scheduler.submit(sample)
    while scheduler.busy:
        scheduler.step()
    counts = np.zeros((VOCAB,) * NEW_TOKENS)
    for sample in samples:
        counts[tuple(sample.tokens)] += 1
    return counts, sum(sample.stats.accepted_draft_tokens for sample in samples)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.ravel() * counts.sum()
    assert counts.ravel()[expected == 0].sum() == 0, "sampled a token the target's distribution excludes"
    keep = expected >= 5
    observed = np.append(counts.ravel()[keep], counts.ravel()[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, top_k=3, top_p=0.9)], ids=["T1", "T0.8-k3-p0.9"])
def test_first_tokens_match_target_sampling(tiny_vocab_pair, sampling: SamplingParams) -> None:
    target_dir, engine = tiny_vocab_pair
    counts, accepted = _dflash_counts(engine, sampling)
    assert accepted > SAMPLES // 20, "the acceptance path was hardly exercised"
    assert _chi_square_p(counts, _target_distribution(target_dir, sampling)) > 1e-3


@pytest.mark.slow
def test_broken_acceptance_fails_the_same_test(tiny_vocab_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting the first draft token whatever the target sampled is not lossless, and the test sees it."""
    target_dir, engine = tiny_vocab_pair
    monkeypatch.setattr(graphs, "accepted_prefix_length", lambda draft, target: torch.ones(draft.shape[0], dtype=torch.long))
    sampling = SamplingParams(1.0)
    counts, _ = _dflash_counts(engine, sampling)
    assert _chi_square_p(counts, _target_distribution(target_dir, sampling)) < 1e-6


@pytest.mark.slow
def test_hybrid_target_sampling_is_lossless_and_broken_acceptance_is_seen(
    tiny_vocab_hybrid_pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwen3_5: the sampled rows' Gated DeltaNet state is rolled back to the accepted prefix like a greedy row's."""
    target_dir, engine = tiny_vocab_hybrid_pair
    sampling = SamplingParams(1.0)
    probs = _target_distribution(target_dir, sampling)
    counts, accepted = _dflash_counts(engine, sampling)
    assert accepted > SAMPLES // 20, "the acceptance path was hardly exercised"
    assert _chi_square_p(counts, probs) > 1e-3
    monkeypatch.setattr(graphs, "accepted_prefix_length", lambda draft, target: torch.ones(draft.shape[0], dtype=torch.long))
    broken, _ = _dflash_counts(engine, sampling)
    assert _chi_square_p(broken, probs) < 1e-6
