"""The embedded SmolLM2-135M-Instruct target: converted from the wheel's GGUF, loaded by our network, equal to transformers."""

from __future__ import annotations

import pytest
import torch
from dflash_trt.builder.drafter_init import choose_mask_token_id
from dflash_trt.builder.embedded import embedded_target_dir
from dflash_trt.builder.networks import load_target
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.mark.slow
def test_smollm2_logits_match_transformers() -> None:
    path = embedded_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def add(a, b):"}], add_generation_prompt=True, tokenize=True
    )
    prompt = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path, tap_layer_ids=(1, 14, 26))
    with torch.no_grad():
        expected = reference(prompt, output_hidden_states=True)
        out = ours(prompt, torch.arange(prompt.shape[1])[None], ours.allocate_cache(1, 0).past(0))
    logits, taps = out.logits, out.taps
    assert (logits - expected.logits).abs().max() <= 1e-4  # fp32; measured 0.0 on this CPU
    assert (taps[..., 576:1152] - expected.hidden_states[15]).abs().max() <= 1e-4
    assert logits[0, -1].argmax() == expected.logits[0, -1].argmax()
    assert choose_mask_token_id(49152, tokenizer) == tokenizer.convert_tokens_to_ids("<empty_output>")
