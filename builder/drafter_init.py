"""A fresh DFlash drafter for any supported target: config derived from the target, random weights, z-lab format.

Tests and `dflash-train` start from this. The config uses z-lab's newer schema (`dflash_config` holding
block_size, mask_token_id and target_layer_ids) so both z-lab's loader and ours read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from dflash_trt.builder.checkpoints import (
    CheckpointError,
    TargetConfig,
    build_target_layer_ids,
    parse_drafter_config,
    parse_target_config,
    read_config_json,
)
from dflash_trt.builder.networks import DrafterNetwork
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase


def choose_mask_token_id(vocab_size: int, tokenizer: PreTrainedTokenizerBase | None) -> int:
    """An existing, unused row of the target vocabulary (never resized or re-initialised).

    The first padding row past the tokenizer's tokens if the embedding table has one (Qwen3: 151669);
    else the highest special token that is not BOS/EOS/PAD/UNK or used by the chat template
    (SmolLM2: 16, <empty_output>). Without a tokenizer (random test targets): the last row.
    """
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    template = str(getattr(tokenizer, "chat_template", "") or "")
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    candidates = [
        token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special and token_id not in reserved and token.content not in template
    ]
    if not candidates:
        raise CheckpointError(
            f"the target's embedding table has no padding rows (vocab_size {vocab_size}, tokenizer {len(tokenizer)} tokens) "
            "and no unused special token; pass mask_token_id explicitly "
            "(a token id the target never emits; dflash-train: --mask-token-id)"
        )
    return max(candidates)


def drafter_config_dict(
    target: TargetConfig,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    num_taps: int | None = None,
    intermediate_size: int | None = None,
    draft_vocab: int = 0,
) -> dict[str, Any]:
    """A z-lab DFlashDraftModel config.json for this target (Qwen3 fields plus dflash_config; `draft_vocab` > 0:
    dflash_config.draft_vocab_size, the drafter drafts only ids below it)."""
    taps = build_target_layer_ids(target.num_layers, num_taps or num_layers)
    dflash_config = {
        "block_size": block_size,
        "mask_token_id": choose_mask_token_id(target.vocab_size, None) if mask_token_id is None else mask_token_id,
        "target_layer_ids": taps,
    }
    if draft_vocab:
        dflash_config["draft_vocab_size"] = draft_vocab
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_parameters["rope_theta"],
        "rope_parameters": dict(target.rope_parameters),
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "num_target_layers": target.num_layers,
        "dtype": "float32",
        "dflash_config": dflash_config,
    }


def init_drafter(config: dict[str, Any], seed: int = 0, std: float = 0.02) -> DrafterNetwork:
    """Random drafter weights: normal(0, std) projections, unit norms (as HF initialises Qwen3)."""
    torch.manual_seed(seed)
    network = DrafterNetwork(parse_drafter_config(config))
    for name, param in network.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)
    return network


def save_drafter(network: DrafterNetwork, config: dict[str, Any], output_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json + model.safetensors in z-lab layout (no embedding, no lm_head)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    (output_dir / "config.json").write_text(json.dumps({**config, "dtype": dtype_name}, indent=2) + "\n")
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in network.state_dict().items()}
    save_file(state, str(output_dir / "model.safetensors"), metadata={"format": "pt"})


def untrained_drafter_dir(target_dir: Path, tokenizer: PreTrainedTokenizerBase | None, block_size: int) -> Path:
    """A freshly initialised one-layer drafter for this target, cached in the data directory (tau ~1 until trained)."""
    from dflash_trt.builder.embedded import data_dir

    output = data_dir() / "drafters" / f"{target_dir.name}-untrained-b{block_size}"
    if not (output / "model.safetensors").is_file():
        target = parse_target_config(read_config_json(target_dir))
        mask_id = choose_mask_token_id(target.vocab_size, tokenizer)
        config = drafter_config_dict(target, num_layers=1, block_size=block_size, mask_token_id=mask_id)
        save_drafter(init_drafter(config), config, output)
    return output
