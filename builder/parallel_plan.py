"""What one GPU holds when TensorRT-LLM shards a pair (--backend trtllm): weights and state per rank, from the
configs alone, and the smallest tensor-parallel size that fits.

Sharding as TensorRT-LLM's PyTorch backend does it (its `Mapping`): tensor parallelism (TP) splits every projection
of the target by heads or columns, the vocabulary of the embedding and LM head, and the Gated DeltaNet heads with
their states; K/V heads are replicated where TP exceeds their number (Qwen3.5 has 2), so each rank keeps
ceil(kv_heads / TP) of them. Expert parallelism (EP) splits the experts of a MoE layer over ranks and TP / EP
splits each expert, so a rank holds 1/TP of the experts' weights either way. Pipeline parallelism (PP) gives each
rank ceil(layers / PP) layers, and the first (embedding) or last (LM head) stage one vocabulary matrix. The drafter
is counted whole on every rank, an upper bound (how TensorRT-LLM places DFlash's draft model is not documented).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash_trt.builder.checkpoints import DrafterConfig, TargetConfig, parse_drafter_config
from dflash_trt.builder.drafter_init import drafter_config_dict
from dflash_trt.builder.plan import DTYPE_BYTES, MemoryPlan, drafter_parameters, human_bytes, memory_plan, target_parameters

TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
MAX_KV_CACHE_FRACTION = 0.9  # TensorRT-LLM's default: the rest of the free memory is its activation workspace
KV_CACHE_HEADROOM = 1.1  # the cache asked for covers the planned sequences with 10% to spare
UNTESTED_TP_NOTE = (
    "DFlash at TP > 1 is young upstream: the DFlash 2 pull request (TensorRT-LLM #18155) calls it untested; smoke-test "
    "TP 2 on your GPUs before relying on a larger one"
)


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


def check_parallelism(target: TargetConfig, parallel: Parallelism) -> None:
    """Refuse what TensorRT-LLM cannot shard (each message names its rule)."""
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    if min(tp, pp, ep) < 1:
        raise ValueError(f"--tp {tp}, --pp {pp} and --ep {ep} must each be at least 1")
    if target.num_heads % tp:
        raise ValueError(f"--tp {tp} must divide the target's {target.num_heads} attention heads")
    if target.linear is not None and target.linear.num_value_heads % tp:
        raise ValueError(f"--tp {tp} must divide the target's {target.linear.num_value_heads} Gated DeltaNet value heads")
    if ep > 1 and target.moe is None:
        raise ValueError(f"--ep {ep}: expert parallelism needs a mixture-of-experts target; {target.model_type} is dense")
    if tp % ep:
        raise ValueError(
            f"--ep {ep} must divide --tp {tp}: TensorRT-LLM splits each expert over TP / EP ranks "
            "(moe_tensor_parallel_size x moe_expert_parallel_size = tensor_parallel_size)"
        )
    if target.moe is not None and target.moe.num_experts % ep:
        raise ValueError(f"--ep {ep} must divide the target's {target.moe.num_experts} experts")
    if pp > target.num_layers:
        raise ValueError(f"--pp {pp} exceeds the target's {target.num_layers} layers")


def _kv_share(target: TargetConfig, tp: int) -> float:
    """The fraction of the K/V heads one rank keeps (replicated where TP exceeds them)."""
    return math.ceil(target.num_kv_heads / tp) / target.num_kv_heads


def rank_weight_parameters(target: TargetConfig, drafter: DrafterConfig | None, parallel: Parallelism) -> int:
    """Parameters on the fullest rank."""
    tp, pp = parallel.tp, parallel.pp
    e = target.hidden_size
    vocabulary = target.vocab_size * e
    vocabulary_matrices = 1 if target.tie_word_embeddings else 2
    layers = target_parameters(target) - vocabulary * vocabulary_matrices - e  # every decoder layer
    kv_matrices = len(target.attention_layers) * 2 * e * target.num_kv_heads * target.head_dim
    per_rank_layers = (layers - kv_matrices) / tp + kv_matrices * _kv_share(target, tp)
    stage_layers = per_rank_layers * math.ceil(target.num_layers / pp) / target.num_layers
    stage_vocabulary = vocabulary * (vocabulary_matrices if pp == 1 else 1) / tp
    drafter_whole = drafter_parameters(drafter) if drafter is not None else 0
    return int(stage_layers + stage_vocabulary) + drafter_whole


@dataclass(frozen=True)
class RankPlan:
    parallel: Parallelism
    weight_bytes: int  # the fullest rank
    state: MemoryPlan  # per rank: its K/V heads and layers, its share of the Gated DeltaNet heads
    drafter_counted: bool

    def sequences_that_fit(self, memory_bytes: int) -> int:
        """Sequences the KV cache this plan asks TensorRT-LLM for can hold: at most MAX_KV_CACHE_FRACTION of what the
        weights leave, with KV_CACHE_HEADROOM to spare (what `dflash-build` writes, so what it accepts)."""
        usable = MAX_KV_CACHE_FRACTION * (memory_bytes - self.weight_bytes) / KV_CACHE_HEADROOM
        return max(0, int(usable // max(1, self.state.bytes_per_sequence)))

    def kv_cache_fraction(self, memory_bytes: int, sequences: int) -> float:
        """TensorRT-LLM's free_gpu_memory_fraction for `sequences` sequences (headroom included), or a clear error."""
        if sequences > self.sequences_that_fit(memory_bytes):
            p = self.parallel
            raise ValueError(
                f"--max-batch-size {sequences} sequences do not fit on one rank of TP {p.tp} x PP {p.pp} in --gpu-memory "
                f"({self.sequences_that_fit(memory_bytes)} would): lower --max-batch-size or --max-seq-len, or raise --tp "
                "(see --plan)"
            )
        need = sequences * self.state.bytes_per_sequence * KV_CACHE_HEADROOM
        return max(0.05, math.ceil(100 * need / (memory_bytes - self.weight_bytes)) / 100)


def rank_plan(
    target: TargetConfig, drafter: DrafterConfig | None, dtype: str, max_seq_len: int, block_size: int, parallel: Parallelism
) -> RankPlan:
    """Weights and state of one rank. Without a drafter config only the target is counted (said in the report)."""
    stand_in = drafter or parse_drafter_config(drafter_config_dict(target, mask_token_id=0))  # its shape: states only
    whole = memory_plan(target, stand_in, dtype, max_seq_len, block_size)
    stages = math.ceil(target.num_layers / parallel.pp) / target.num_layers
    state = MemoryPlan(
        weight_bytes=0,
        kv_bytes_per_token=int(whole.kv_bytes_per_token * _kv_share(target, parallel.tp) * stages),
        draft_bytes_per_token=whole.draft_bytes_per_token if drafter is not None else 0,  # whole on every rank
        recurrent_bytes_per_sequence=int(whole.recurrent_bytes_per_sequence / parallel.tp * stages),
        positions=whole.positions,
    )
    weights = rank_weight_parameters(target, drafter, parallel) * DTYPE_BYTES[dtype]
    return RankPlan(parallel, weights, state, drafter is not None)


def smallest_tp(
    target: TargetConfig,
    drafter: DrafterConfig | None,
    dtype: str,
    max_seq_len: int,
    block_size: int,
    memory_bytes: int,
    sequences: int,
) -> int | None:
    """The smallest TP (EP = TP for MoE targets, PP 1) at which `sequences` sequences fit on each rank."""
    for tp in TP_CANDIDATES:
        parallel = Parallelism(tp=tp, ep=tp if target.moe is not None else 1)
        try:
            check_parallelism(target, parallel)
        except ValueError:
            continue
        if rank_plan(target, drafter, dtype, max_seq_len, block_size, parallel).sequences_that_fit(memory_bytes) >= sequences:
            return tp
    return None


def describe_ranks(plan: RankPlan, dtype: str, max_seq_len: int, memory_bytes: int, smallest: int | None, sequences: int) -> str:
    p, fit = plan.parallel, plan.sequences_that_fit(memory_bytes)
    drafter = "target + drafter (whole on each rank)" if plan.drafter_counted else "target only: no drafter config here"
    rows = [
        (f"GPUs (TP {p.tp} x PP {p.pp}; EP {p.ep})", str(p.gpus)),
        (f"weights per rank ({dtype}, {drafter})", human_bytes(plan.weight_bytes)),
        ("target attention K/V per token per rank", human_bytes(plan.state.kv_bytes_per_token)),
        ("drafter context K/V per token per rank", human_bytes(plan.state.draft_bytes_per_token)),
        ("recurrent state per sequence per rank", human_bytes(plan.state.recurrent_bytes_per_sequence)),
        (f"sequences of {max_seq_len} tokens per rank in {human_bytes(memory_bytes)} (90% of the rest, 10% spare)", str(fit)),
        (f"smallest TP that fits {sequences} sequences", str(smallest) if smallest else "none up to 64"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name.ljust(width)}  {value}" for name, value in rows)
