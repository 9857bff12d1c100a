"""The target network equals transformers' own models: prefill logits, taps, and a 16-token verify on a cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash_trt.builder.networks import load_target
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
        prefill = ours(prompt, torch.arange(23)[None], kv.past(0))
        kv.write(torch.arange(23)[None], prefill.k, prefill.v)
        verify = ours(block, torch.arange(23, 39)[None], kv.past(23))
        # Stale rows past the block's start must not matter: a full-size past with garbage gives the same logits.
        kv.write(torch.arange(23, 64)[None], torch.randn_like(kv.k[:, :, 23:]), torch.randn_like(kv.v[:, :, 23:]))
        verify_stale = ours(block, torch.arange(23, 39)[None], kv.past(64))
        logits, verify_logits, verify_taps = prefill.logits, verify.logits, verify.taps

    assert (logits - ref_prefill.logits).abs().max() <= TOLERANCE
    assert (verify_logits - ref_verify.logits).abs().max() <= TOLERANCE
    assert (verify_stale.logits - ref_verify.logits).abs().max() <= TOLERANCE
    ref_taps = torch.cat([ref_verify.hidden_states[i + 1] for i in taps], dim=-1)
    assert (verify_taps - ref_taps).abs().max() <= TOLERANCE
    # The check is not vacuous: a one-position shift of the cache breaks it.
    shifted = ours(block, torch.arange(24, 40)[None], kv.past(24)).logits
    assert (shifted - ref_verify.logits).abs().max() > 100 * TOLERANCE


def test_batch_rows_with_different_positions_are_independent(tiny_targets: dict[str, Path]) -> None:
    ours = load_target(tiny_targets["qwen3"], tap_layer_ids=(2,))
    torch.manual_seed(3)
    prompts = [torch.randint(0, 96, (1, 5)), torch.randint(0, 96, (1, 9))]
    batched_kv = ours.allocate_cache(2, 32)
    single = []
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            length = prompt.shape[1]
            kv = ours.allocate_cache(1, 32)
            out = ours(prompt, torch.arange(length)[None], kv.past(0))
            kv.write(torch.arange(length)[None], out.k, out.v)
            batched_kv.k[:, row, :length], batched_kv.v[:, row, :length] = out.k[:, 0], out.v[:, 0]
            single.append(ours(torch.tensor([[7, 8]]), torch.arange(length, length + 2)[None], kv.past(length)).logits)
        # Row 0's rows 5..8 are stale (never written for it) but lie ahead of its positions.
        batched = ours(torch.tensor([[7, 8], [7, 8]]), torch.tensor([[5, 6], [9, 10]]), batched_kv.past(9)).logits
    assert (batched[0] - single[0][0]).abs().max() <= TOLERANCE
    assert (batched[1] - single[1][0]).abs().max() <= TOLERANCE
