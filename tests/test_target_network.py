"""The target network equals transformers' own models: prefill logits, taps, and a 16-token verify on a cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash_trt.builder.networks import KVCache, load_target
from transformers import AutoModelForCausalLM, DynamicCache

TOLERANCE = 1e-4  # fp32, max abs difference of logits


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_prefill_and_verify_logits_match_transformers(model_type: str, tiny_targets: dict[str, Path]) -> None:
    path = tiny_targets[model_type]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    taps = (1, 3, 5)
    ours = load_target(path, tap_layer_ids=taps)
    torch.manual_seed(7)
    prompt = torch.randint(0, 96, (1, 23))
    block = torch.randint(0, 96, (1, 16))

    with torch.no_grad():
        cache = DynamicCache(config=reference.config)
        ref_prefill = reference(prompt, past_key_values=cache, use_cache=True, output_hidden_states=True)
        ref_verify = reference(block, past_key_values=cache, use_cache=True, output_hidden_states=True)

        kv = ours.allocate_cache(1, 64)
        logits, tap_features = ours(prompt, torch.arange(23)[None], kv)
        verify_logits, verify_taps = ours(block, torch.arange(23, 39)[None], kv)

    assert (logits - ref_prefill.logits).abs().max() <= TOLERANCE
    assert (verify_logits - ref_verify.logits).abs().max() <= TOLERANCE
    ref_taps = torch.cat([ref_verify.hidden_states[i + 1] for i in taps], dim=-1)
    assert (verify_taps - ref_taps).abs().max() <= TOLERANCE
    # The check is not vacuous: a one-position shift of the cache breaks it.
    shifted, _ = ours(block, torch.arange(24, 40)[None], ours.allocate_cache(1, 64))
    assert (shifted - ref_verify.logits).abs().max() > 100 * TOLERANCE


def test_batch_rows_with_different_positions_are_independent(tiny_targets: dict[str, Path]) -> None:
    ours = load_target(tiny_targets["qwen3"], tap_layer_ids=(2,))
    torch.manual_seed(3)
    short, long = torch.randint(0, 96, (1, 5)), torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        single = []
        for prompt in (short, long):
            kv = ours.allocate_cache(1, 32)
            ours(prompt, torch.arange(prompt.shape[1])[None], kv)
            single.append(ours(torch.tensor([[7, 8]]), torch.arange(prompt.shape[1], prompt.shape[1] + 2)[None], kv)[0])
        kv = ours.allocate_cache(2, 32)
        ours(short, torch.arange(5)[None], _row(kv, 0))
        ours(long, torch.arange(9)[None], _row(kv, 1))
        batched, _ = ours(torch.tensor([[7, 8], [7, 8]]), torch.tensor([[5, 6], [9, 10]]), kv)
    assert (batched[0] - single[0][0]).abs().max() <= TOLERANCE
    assert (batched[1] - single[1][0]).abs().max() <= TOLERANCE


def _row(cache: KVCache, row: int) -> KVCache:  # a one-sequence view into a batched cache
    return KVCache(cache.k[:, row : row + 1], cache.v[:, row : row + 1])
