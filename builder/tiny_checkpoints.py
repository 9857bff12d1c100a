"""Tiny random checkpoints in the formats users have (transformers' own `save_pretrained`, a `tokenizer.json`,
z-lab-format drafters), for the tests and the GPU check: small enough to build and serve in seconds, with weights
peaked enough that greedy choices are far from ties (a meaningful exactness check across devices and dtypes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from dflash_trt.builder.checkpoints import parse_target_config, read_config_json
from dflash_trt.builder.drafter_init import drafter_config_dict, init_drafter, save_drafter

TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=None,
    bos_token_id=0,
    pad_token_id=None,
)
MODEL_TYPES = ("llama", "qwen2", "qwen3")


def tiny_config(model_type: str) -> Any:
    """The transformers config of a tiny `model_type` target."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    untied: dict[str, Any] = {**TINY, "rope_theta": 1e6, "tie_word_embeddings": False}
    if model_type == "llama":
        return LlamaConfig(**{**TINY, "rope_theta": 10000.0, "tie_word_embeddings": True})
    if model_type == "qwen2":
        return Qwen2Config(**untied)
    if model_type == "qwen3":
        return Qwen3Config(**untied, head_dim=24)
    raise ValueError(f"model_type {model_type!r}: use one of {MODEL_TYPES}")


def write_tiny_tokenizer(output_dir: Path, vocab_size: int = 96) -> None:
    """A word-level tokenizer over `<s>`, then `w1` .. `w{V-1}` (whitespace-separated), in HF's tokenizer.json format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<s>").save_pretrained(output_dir)


def peak_weights(model: torch.nn.Module, std: float) -> None:
    """Larger-than-default random weights, so a tiny model's logits are peaked enough to be a meaningful check (greedy
    choices far from ties); norms and Gated DeltaNet decays (A_log, dt_bias) keep their initial values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not any(part in name for part in ("norm", "A_log", "dt_bias")):
                param.normal_(0.0, std)


def write_tiny_target(model_type: str, output_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    peak_weights(model, 0.08)
    model.save_pretrained(output_dir)
    write_tiny_tokenizer(output_dir, config.vocab_size)
    return output_dir


def write_tiny_drafter(target_dir: Path, output_dir: Path, seed: int = 1, **overrides: object) -> Path:
    target = parse_target_config(read_config_json(target_dir))
    config = drafter_config_dict(target, num_layers=2, block_size=16)
    config.update(overrides)
    network = init_drafter(config, seed=seed, std=0.08)
    save_drafter(network, config, output_dir)
    return output_dir


def write_trained_tiny_drafter(target_dir: Path, output_dir: Path, work_dir: Path, steps: int = 300) -> Path:
    """A drafter for the tiny target at `target_dir`, briefly trained on the target's own greedy continuations of
    64 random prompts, so long runs of drafts get accepted (steps=300: about a minute on 2 CPU cores)."""
    from dflash_trt.builder.networks import load_drafter, load_target
    from dflash_trt.builder.training import TrainSettings, generate_responses, make_examples, train_drafter

    untrained = write_tiny_drafter(target_dir, work_dir / "untrained")
    drafter = load_drafter(untrained)
    target = load_target(target_dir, drafter.config.target_layer_ids)
    prompts = torch.randint(1, 90, (64, 16), generator=torch.Generator().manual_seed(0))
    sequences = generate_responses(target, prompts.tolist(), 64)
    examples = make_examples(target, list(sequences), [1] * len(sequences))
    train_drafter(drafter, target, examples, TrainSettings(steps=steps, compute_dtype=torch.float32))  # AVX2: see compute_dtype
    save_drafter(drafter, json.loads((untrained / "config.json").read_text()), output_dir)
    return output_dir
