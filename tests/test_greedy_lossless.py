"""Greedy DFlash output equals transformers' plain greedy generate() token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.networks import load_drafter, load_target
from dflash_trt.runtime.engine import GraphEngine
from dflash_trt.runtime.loop import generate, generate_plain
from transformers import AutoModelForCausalLM

NUM_PROMPTS, NEW_TOKENS = 20, 64


def _engine(target_dir: Path, drafter_dir: Path) -> GraphEngine:
    drafter = load_drafter(drafter_dir)
    return torch_engine(load_target(target_dir, drafter.config.target_layer_ids), drafter, max_seq_len=256)


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (NUM_PROMPTS,), generator=generator)
    return [torch.randint(1, 90, (int(n),), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_random_drafter_greedy_equals_transformers(model_type: str, tiny_targets: dict[str, Path], tmp_path: Path) -> None:
    from dflash_trt.builder.tiny_checkpoints import write_tiny_drafter

    engine = _engine(tiny_targets[model_type], write_tiny_drafter(tiny_targets[model_type], tmp_path / "d"))
    model = AutoModelForCausalLM.from_pretrained(tiny_targets[model_type], dtype=torch.float32).eval()
    for prompt in _prompts(seed=1):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        result = generate(engine, prompt, NEW_TOKENS)
        assert result.tokens == expected[0, len(prompt) :].tolist()
        stats = result.stats  # every token but the prefill one came from a step; tau is tokens per step
        assert sum(stats.acceptance_lengths) == NEW_TOKENS - 1 and len(stats.acceptance_lengths) == stats.steps
        assert stats.tau == pytest.approx((NEW_TOKENS - 1) / stats.steps)


def test_trained_drafter_greedy_equals_transformers_with_long_accepts(
    tiny_targets: dict[str, Path], trained_drafter: Path
) -> None:
    engine = _engine(tiny_targets["qwen3"], trained_drafter)
    model = AutoModelForCausalLM.from_pretrained(tiny_targets["qwen3"], dtype=torch.float32).eval()
    longest = 0
    for prompt in _prompts(seed=2):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        result = generate(engine, prompt, NEW_TOKENS)
        assert result.tokens == expected[0, len(prompt) :].tolist()
        assert generate_plain(engine, prompt, NEW_TOKENS).tokens == result.tokens
        longest = max(longest, max(result.stats.acceptance_lengths))
        stats = result.stats
        assert sum(stats.acceptance_lengths) == NEW_TOKENS - 1  # every token but the prefill one came from a step
        assert stats.accepted_draft_tokens >= sum(stats.acceptance_lengths) - stats.steps
    assert longest >= 9, f"no step accepted >= 8 draft tokens (longest emitted run {longest})"


def test_dflash_generate_streams_the_greedy_text_and_compares_with_plain(
    tiny_targets: dict[str, Path], trained_drafter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI streams what `generate` returns, decoded, and `--compare-plain` checks it against plain decoding."""
    from dflash_trt.runtime.cli import main as dflash_generate
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_targets["qwen3"])
    prompt = "w5 w35 w89 w7"
    argv = ["--target", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--prompt", prompt, "--raw"]
    assert dflash_generate([*argv, "--max-tokens", str(NEW_TOKENS), "--compare-plain"]) == 0
    streamed = capsys.readouterr()
    expected = generate(_engine(tiny_targets["qwen3"], trained_drafter), tokenizer(prompt)["input_ids"], NEW_TOKENS)
    assert streamed.out == tokenizer.decode(expected.tokens)
    assert f"tau (tokens/step incl. bonus) {expected.stats.tau:.2f}" in streamed.err
    assert "identical to plain: True" in streamed.err
