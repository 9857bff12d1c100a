"""Checkpoint loading: HF target checkpoints and z-lab DFlash drafter checkpoints.

A target is a directory with `config.json` and safetensors weights (`model.safetensors` or shards).
A drafter is a z-lab DFlash directory: `config.json` with `architectures: ["DFlashDraftModel"]`, Qwen3
fields, `num_target_layers`, and `block_size` either top-level (legacy schema) or inside `dflash_config`
(newer schema, which also holds `mask_token_id`, `target_layer_ids`, optional `causal`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

SUPPORTED_TARGET_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
NOT_YET_SUPPORTED = {
    "qwen3_next": "its fused in_proj_qkvz/in_proj_ba projections and mixture-of-experts MLP are not built yet",
}
NOT_BUILT_HERE = {  # read (plans, --backend trtllm), not built into this toolkit's own engines
    "qwen3_5_moe": "its mixture-of-experts MLP (router, experts and shared expert) is not built yet; its Gated DeltaNet "
    "and attention layers are those of qwen3_5. Serve it with --backend trtllm (TensorRT-LLM's PyTorch engine)",
}
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")  # Gated DeltaNet + gated full attention
WRAPPED_TYPES = ("qwen3_5", "qwen3_5_moe")  # published as vision-language wrappers, the language model in text_config
SKIPPED_WEIGHTS = ("visual.", "mtp.")  # a qwen3_5 checkpoint's vision tower and multi-token-prediction head
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DRAFTER_ARCHITECTURE = "DFlashDraftModel"


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, unsupported, or does not fit its partner."""


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid target."""

    num_key_heads: int  # Hk
    num_value_heads: int  # Hv (a multiple of Hk)
    key_head_dim: int  # dk
    value_head_dim: int  # dv
    conv_kernel: int  # K

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP of a qwen3_5_moe target: routed experts plus one gated shared expert per layer."""

    num_experts: int  # E
    experts_per_token: int  # routed experts per token
    expert_intermediate_size: int  # m: each expert is a SwiGLU MLP e -> m -> e
    shared_expert_intermediate_size: int  # s: the shared expert, e -> s -> e


@dataclass(frozen=True)
class TargetConfig:
    """The fields of an HF decoder-only config that the target network needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    # Hybrid targets (qwen3_5): which token mixer each layer has, and what differs from Llama/Qwen3.
    layer_types: tuple[str, ...] = ()  # "full_attention" | "linear_attention" per layer; () = all full attention
    linear: LinearAttentionConfig | None = None
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims only
    gated_attention: bool = False  # q_proj also yields a per-head output gate: o_proj(attn * sigmoid(gate))
    zero_centered_norms: bool = False  # RMSNorms scale by (1 + w), computed in fp32
    moe: MoeConfig | None = None  # every layer's MLP is a mixture of experts (qwen3_5_moe); None: dense

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_types and self.layer_types[i] == "linear_attention")


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter: Qwen3-style layers with KV injection, reading target taps."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    qkv_bias: bool
    hidden_act: str
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    layer_causal: tuple[bool, ...]  # per drafter layer: causal inside the block
    layer_window: tuple[int | None, ...]  # per drafter layer: sliding window, None = unlimited
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_vocab_size: int = 0  # trained to draft only ids below this (dflash-train --draft-vocab); 0: the whole vocabulary
    extra: dict[str, Any] = field(default_factory=dict)


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Default tap layers: one tap -> the middle layer; n taps -> spread over layers 1..N-3."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


def read_config_json(checkpoint_dir: Path) -> dict[str, Any]:
    config_path = checkpoint_dir / "config.json"
    if not checkpoint_dir.is_dir():
        raise CheckpointError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist; pass a local directory holding "
            "config.json and *.safetensors (download it first, e.g. `hf download ORG/NAME --local-dir DIR`)"
        )
    if not config_path.is_file():
        raise CheckpointError(
            f"{str(checkpoint_dir)!r} has no config.json; a checkpoint directory needs config.json and *.safetensors"
        )
    try:
        loaded: dict[str, Any] = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path} is not valid JSON: {error}") from error
    return loaded


def _rope_parameters(raw: dict[str, Any], where: str) -> dict[str, Any]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in STATIC_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: rope_type {params['rope_type']!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)}); "
            "length-dependent RoPE cannot be baked into a static engine"
        )
    return params


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise CheckpointError(f"checkpoint dtype {name!r} is not supported; use one of {sorted(dtypes)}")
    return dtypes[name]


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A qwen3_5 checkpoint as published is the vision-language wrapper: its language model's config is nested in
    `text_config`; fields it leaves out (dtype, tied embeddings, token ids) come from the wrapper."""
    if raw.get("model_type") not in WRAPPED_TYPES or "text_config" not in raw:
        return raw
    text = dict(raw["text_config"])
    for name in ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if text.get(name) is None and raw.get(name) is not None:
            text[name] = raw[name]
    return {**text, "model_type": raw["model_type"]}


def _layer_types(raw: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    """qwen3_5: `layer_types`, else every `full_attention_interval`-th layer (default 4) is full attention."""
    interval = int(raw.get("full_attention_interval", 4))
    types = raw.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if len(types) != num_layers or unknown:
        raise CheckpointError(
            f"{where}: layer_types must list linear_attention/full_attention for each of the {num_layers} layers "
            f"(got {len(types)} entries{', unknown ' + str(unknown) if unknown else ''})"
        )
    return tuple(types)


def _hybrid_fields(raw: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    rope = raw.get("rope_parameters") or {}
    return {
        "layer_types": _layer_types(raw, num_layers, where),
        "linear": LinearAttentionConfig(
            num_key_heads=int(raw["linear_num_key_heads"]),
            num_value_heads=int(raw["linear_num_value_heads"]),
            key_head_dim=int(raw["linear_key_head_dim"]),
            value_head_dim=int(raw["linear_value_head_dim"]),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        ),
        "partial_rotary_factor": float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))),
        "gated_attention": True,
        "zero_centered_norms": True,
    }


def parse_target_config(raw: dict[str, Any], where: str = "target") -> TargetConfig:
    model_type = raw.get("model_type")
    if model_type in NOT_YET_SUPPORTED:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported yet: {NOT_YET_SUPPORTED[model_type]}")
    raw = _text_config(raw)
    if model_type not in SUPPORTED_TARGET_TYPES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported as a target; supported: {', '.join(SUPPORTED_TARGET_TYPES)}"
        )
    if model_type == "qwen2" and raw.get("use_sliding_window", False):
        raise CheckpointError(f"{where}: qwen2 with use_sliding_window=true is not supported; set it to false")
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    attention_bias = bool(raw.get("attention_bias", False))
    hybrid = _hybrid_fields(raw, int(raw["num_hidden_layers"]), where) if model_type in HYBRID_TYPES else {}
    moe = _moe_config(raw) if "num_experts" in raw else None
    return TargetConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw.get("intermediate_size") or 0),  # 0: MoE only
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(raw, where),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", *HYBRID_TYPES),
        hidden_act=str(raw.get("hidden_act", "silu")),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        dtype=checkpoint_dtype(raw),
        moe=moe,
        **hybrid,
    )


def _moe_config(raw: dict[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=int(raw["num_experts"]),
        experts_per_token=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def require_buildable(config: TargetConfig, where: str = "target") -> None:
    """Refuse a target this toolkit reads but does not build into its own engines (ONNX Runtime, TensorRT, torch)."""
    kind = config.model_type.removesuffix("_text")  # the wrapper's type and its text model's read alike
    if kind in NOT_BUILT_HERE:
        raise CheckpointError(f"{where}: model_type {kind!r} is not supported yet: {NOT_BUILT_HERE[kind]}")


def _dflash_value(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """Newer schema keeps DFlash fields in `dflash_config`; the legacy one keeps them top-level."""
    nested = raw.get("dflash_config") or {}
    return nested.get(name, raw.get(name, default))


def _layer_attention_shape(raw: dict[str, Any], num_layers: int) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise CheckpointError(f"drafter: layer_types has {len(layer_types)} entries for {num_layers} layers")
    causal_override = _dflash_value(raw, "causal", raw.get("is_causal"))
    causal: list[bool] = []
    window: list[int | None] = []
    for layer_type in layer_types:
        if layer_type not in ("full_attention", "sliding_attention"):
            raise CheckpointError(f"drafter: layer type {layer_type!r} is not supported; use full_attention or sliding_attention")
        sliding = layer_type == "sliding_attention"
        causal.append(sliding if causal_override is None else bool(causal_override))
        window.append(int(raw["sliding_window"]) if sliding else None)
    return tuple(causal), tuple(window)


def parse_drafter_config(raw: dict[str, Any], where: str = "drafter") -> DrafterConfig:
    architectures = raw.get("architectures") or []
    if DRAFTER_ARCHITECTURE not in architectures:
        raise CheckpointError(
            f"{where}: architectures {architectures!r} does not name {DRAFTER_ARCHITECTURE!r}; "
            "pass a z-lab DFlash drafter checkpoint (DFlash2DraftModel is not supported yet)"
        )
    num_layers = int(raw["num_hidden_layers"])
    if "num_target_layers" not in raw:
        raise CheckpointError(f"{where}: config.json lacks num_target_layers (the target's decoder layer count)")
    num_target_layers = int(raw["num_target_layers"])
    mask_token_id = _dflash_value(raw, "mask_token_id")
    if mask_token_id is None:
        raise CheckpointError(f"{where}: no mask_token_id (in dflash_config or top-level); set an unused vocabulary row")
    layer_ids = _dflash_value(raw, "target_layer_ids") or build_target_layer_ids(num_target_layers, num_layers)
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    causal, window = _layer_attention_shape(raw, num_layers)
    softcap = _dflash_value(raw, "final_logit_softcapping")
    return DrafterConfig(
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(raw, where),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        vocab_size=int(raw.get("vocab_size", 0)),
        num_target_layers=num_target_layers,
        target_layer_ids=tuple(int(i) for i in layer_ids),
        block_size=int(_dflash_value(raw, "block_size", 16)),
        mask_token_id=int(mask_token_id),
        layer_causal=causal,
        layer_window=window,
        input_embedding_scale=float(_dflash_value(raw, "input_embedding_scale", 1.0)),
        output_multiplier=float(_dflash_value(raw, "output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
        draft_vocab_size=int(_dflash_value(raw, "draft_vocab_size", 0) or 0),
    )


def check_pair(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Raise a CheckpointError naming the mismatch if this drafter cannot serve this target."""
    if drafter.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}: "
            "the drafter reads target embeddings and taps, so it must be trained for this target"
        )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise CheckpointError(
            f"drafter mask_token_id {drafter.mask_token_id} is outside the target vocabulary [0, {target.vocab_size}); "
            "set dflash_config.mask_token_id to an unused row of the target's embedding table"
        )
    bad_taps = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_taps:
        raise CheckpointError(
            f"drafter target_layer_ids {list(drafter.target_layer_ids)} include {bad_taps}, not below the target's "
            f"{target.num_layers} layers; the drafter was made for a different target"
        )
    if drafter.num_target_layers != target.num_layers:
        raise CheckpointError(
            f"drafter num_target_layers {drafter.num_target_layers} != target num_hidden_layers {target.num_layers}: "
            "the drafter was made for a different target"
        )


def _network_name(name: str) -> str:
    """A checkpoint tensor's name as the networks call it: `model.` (and qwen3_5's `model.language_model.`) dropped."""
    return name.removeprefix("model.").removeprefix("language_model.")


def skipped_weights(checkpoint_dir: Path) -> list[str]:
    """The weight groups of a checkpoint that are not built (a qwen3_5 vision tower, its MTP head), for the manifest;
    read from the safetensors headers only."""
    found: set[str] = set()
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            found.update(p for name in handle.keys() for p in SKIPPED_WEIGHTS if _network_name(name).startswith(p))
    return sorted(f"{prefix}*" for prefix in found)


def load_safetensors_dir(checkpoint_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors the networks are built from, of every *.safetensors file in the directory, under their network
    names, each cast to `dtype` as it is read (one tensor at a time: never the checkpoint twice in memory); the
    weights that are not built (SKIPPED_WEIGHTS) are never read."""
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{str(checkpoint_dir)!r} holds no *.safetensors weights; convert .bin/.gguf checkpoints to safetensors first"
        )
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                if not _network_name(name).startswith(SKIPPED_WEIGHTS):
                    state[_network_name(name)] = handle.get_tensor(name).to(dtype)
    return state
