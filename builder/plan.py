"""dflash-build --plan: what a target and its drafter will cost, computed from their configs alone (no weights).

Weights are counted from the config (the language model only: a qwen3_5 checkpoint's vision tower and MTP head
are not built). Per sequence the engine keeps the target's attention K/V and the drafter's context K/V for every
position (max_seq_len + block_size rows), and for hybrid targets one Gated DeltaNet state (fp32) and one conv
window per linear-attention layer, whatever the length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_trt.builder.checkpoints import DrafterConfig, TargetConfig
from dflash_trt.builder.graphs import engine_states
from dflash_trt.builder.qdq import INT4_BLOCKS
from dflash_trt.builder.quantize import BLOCK_SIZE, LM_HEAD_BITS, MODES, QuantizationMode
from dflash_trt.runtime.graph_io import owner

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'141GB', '80GiB', '1.5TB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 141GB or 80GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def mlp_parameters(c: TargetConfig) -> int:
    """One layer's MLP: a SwiGLU, or (qwen3_5_moe) a router, the routed experts and a gated shared expert."""
    e = c.hidden_size
    if c.moe is None:
        return 3 * e * c.intermediate_size
    m = c.moe
    experts = m.num_experts * 3 * e * m.expert_intermediate_size
    return e * m.num_experts + experts + 3 * e * m.shared_expert_intermediate_size + e


def target_parameters(c: TargetConfig) -> int:
    e, d, mlp = c.hidden_size, c.head_dim, mlp_parameters(c)
    norms = 2 * e
    attention = target_attention_matrices(c) + (2 * d if c.qk_norm else 0)
    if c.qkv_bias:
        attention += c.num_heads * d * (2 if c.gated_attention else 1) + 2 * c.num_kv_heads * d
    total = len(c.attention_layers) * (attention + mlp + norms)
    if c.linear is not None:
        g = c.linear
        mixer = target_linear_mixer_matrices(c) + g.conv_dim * g.conv_kernel
        mixer += 2 * g.num_value_heads + g.value_head_dim  # dt_bias, A_log, gated norm
        total += len(c.linear_layers) * (mixer + mlp + norms)
    embeddings = c.vocab_size * e * (1 if c.tie_word_embeddings else 2)
    return total + embeddings + e


def target_attention_matrices(c: TargetConfig) -> int:
    """Weights of one attention layer's projections (q [and gate], k, v, o)."""
    e, d = c.hidden_size, c.head_dim
    return e * c.num_heads * d * (2 if c.gated_attention else 1) + 2 * e * c.num_kv_heads * d + c.num_heads * d * e


def target_linear_mixer_matrices(c: TargetConfig) -> int:
    """Weights of one Gated DeltaNet layer's projections (in_proj_qkv, z, b, a; out_proj)."""
    assert c.linear is not None
    g, e = c.linear, c.hidden_size
    return e * g.conv_dim + e * g.value_dim + 2 * e * g.num_value_heads + g.value_dim * e


def matrix_parameters(target: TargetConfig, drafter: DrafterConfig) -> int:
    """The weights that --quantize quantizes: every linear layer's matrix but the LM head (embeddings excluded)."""
    mlp = 3 * target.hidden_size * target.intermediate_size
    total = len(target.attention_layers) * (target_attention_matrices(target) + mlp)
    if target.linear is not None:
        total += len(target.linear_layers) * (target_linear_mixer_matrices(target) + mlp)
    e, d = drafter.hidden_size, drafter.head_dim
    attention = e * drafter.num_heads * d + 2 * e * drafter.num_kv_heads * d + drafter.num_heads * d * e
    return total + len(drafter.target_layer_ids) * e * e + drafter.num_layers * (attention + 3 * e * drafter.intermediate_size)


def drafter_parameters(c: DrafterConfig) -> int:
    e, d = c.hidden_size, c.head_dim
    attention = e * c.num_heads * d + 2 * e * c.num_kv_heads * d + c.num_heads * d * e + 2 * d
    layer = attention + 3 * e * c.intermediate_size + 2 * e
    return len(c.target_layer_ids) * e * e + e + c.num_layers * layer + e  # fc, hidden_norm, layers, norm


def weight_bytes(target: TargetConfig, drafter: DrafterConfig, dtype: str, quantization: QuantizationMode) -> int:
    """Bytes of the built weights: the LM head is stored apart from the embedding (transposed) even when tied; a
    quantized matrix costs bits/8 per weight plus one float32 scale per BLOCK_SIZE weights."""
    head = target.vocab_size * target.hidden_size
    matrices = matrix_parameters(target, drafter)
    rest = target_parameters(target) + drafter_parameters(drafter) - matrices - head * (1 if target.tie_word_embeddings else 2)
    if quantization.bits == 0:
        return (rest + head + matrices + head) * DTYPE_BYTES[dtype]
    if quantization.form == "qdq":  # TensorRT's forms: the LM head in the dtype; a scale per block (INT4) or column
        scale = DTYPE_BYTES[dtype] / (INT4_BLOCKS[0] if quantization.bits == 4 else target.hidden_size)
        return int((rest + head + head) * DTYPE_BYTES[dtype] + matrices * (quantization.bits / 8 + scale))
    scale = 4 / BLOCK_SIZE
    return int(
        (rest + head) * DTYPE_BYTES[dtype] + matrices * (quantization.bits / 8 + scale) + head * (LM_HEAD_BITS / 8 + scale)
    )


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    kv_bytes_per_token: int  # the target's attention K/V
    draft_bytes_per_token: int  # the drafter's context K/V
    recurrent_bytes_per_sequence: int  # Gated DeltaNet states (fp32) and conv windows
    positions: int  # rows per sequence: max_seq_len + block_size

    @property
    def bytes_per_sequence(self) -> int:
        return self.positions * (self.kv_bytes_per_token + self.draft_bytes_per_token) + self.recurrent_bytes_per_sequence

    def sequences_that_fit(self, memory_bytes: int) -> int:
        return max(0, (memory_bytes - self.weight_bytes) // self.bytes_per_sequence)


def memory_plan(
    target: TargetConfig,
    drafter: DrafterConfig,
    dtype: str,
    max_seq_len: int,
    block_size: int,
    quantization: QuantizationMode = MODES["none"],
) -> MemoryPlan:
    """The bytes of the states the engine would hold (`engine_states`, the description the engine itself is built
    from) and of the weights."""
    positions = max_seq_len + block_size
    states = engine_states(target, drafter, positions, dtype)

    def per_token(owner_name: str) -> int:
        return sum(s.bytes_per_sequence for s in states if s.kind == "positional" and owner(s) == owner_name) // positions

    return MemoryPlan(
        weight_bytes=weight_bytes(target, drafter, dtype, quantization),
        kv_bytes_per_token=per_token("target"),
        draft_bytes_per_token=per_token("draft"),
        recurrent_bytes_per_sequence=sum(s.bytes_per_sequence for s in states if s.kind == "recurrent"),
        positions=positions,
    )


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def describe(plan: MemoryPlan, dtype: str, max_seq_len: int, memory_bytes: int | None, quantization: str = "none") -> str:
    weights = dtype if quantization == "none" else f"{quantization} linear layers, {dtype} embeddings"
    rows = [
        (f"weights ({weights}, target + drafter)", human_bytes(plan.weight_bytes)),
        ("target attention K/V per token", human_bytes(plan.kv_bytes_per_token)),
        ("drafter context K/V per token", human_bytes(plan.draft_bytes_per_token)),
        ("recurrent state per sequence", human_bytes(plan.recurrent_bytes_per_sequence)),
        (f"per sequence of {max_seq_len} tokens (+ block)", human_bytes(plan.bytes_per_sequence)),
    ]
    if memory_bytes is not None:
        fit = plan.sequences_that_fit(memory_bytes)
        fitting = f"sequences of {max_seq_len} tokens in {human_bytes(memory_bytes)}"
        rows.append((fitting, f"{fit} (after the weights; nothing else counted)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)
