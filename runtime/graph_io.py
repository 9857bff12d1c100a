"""The graphs' named, typed inputs and outputs: one schema that export, the runners and the TensorRT profiles read.

Four graphs, all batched with per-row positions, parameters and uniforms:

prefill  prompt tokens at positions start..start+P-1 (start > 0: a reused prefix's rows are in the slot) -> first
         token, first draft block, every state's rows for those positions
step     block (verify width V) -> the target's token at every slot, accepted prefix, next draft block, state rows
verify   the same without drafting (the next "block" is the bonus token alone): DFlash with nothing to verify
decode   plain decoding: verify without taps, target states only (the baseline on the same engine)

Graphs read states from the engine's pool by `slots` [batch] and position: rows < start of each sequence are
visible, and only the first R = len(visible_rows) positions are read. The prefill continues a slot's recurrent
states where start > 0 (a reused sequence: the states hold exactly its first `start` tokens) and starts them from
zero where start = 0, whatever the pool holds. A positional state enters
flat, [layers * slots * positions, *row_shape] (a view of the pool: no reshape inside the graph, which would copy
the whole pool on some runtimes). Graphs return the rows they computed (positions start..start+V-1, or +P-1) as
`{state}_rows`, which the engine writes into the pool in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from dflash_trt.runtime.states import StateSpec

GRAPH_NAMES = ("prefill", "step", "verify", "decode")
# The version of this schema a build's graphs follow (its manifest's `graph_schema`): the runtime serves only graphs of
# its own. 2: the prefill reads the pool (prompt prefix reuse); 3: a hybrid target's prefill reads its recurrent states.
GRAPH_SCHEMA = 3


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "int64" | "float32" | "state" (the dtype of the engine's states)
    axes: tuple[str, ...]  # symbolic axes; fixed sizes are written as digits


SAMPLING = (
    TensorSpec("temperature", "float32", ("batch",)),  # 0 = greedy
    TensorSpec("top_k", "int64", ("batch",)),  # 0 = no limit
    TensorSpec("top_p", "float32", ("batch",)),
    TensorSpec("sampled_rows", "int64", ("sampled",)),  # rows with temperature > 0: only they pay for sampling
    TensorSpec("candidate_slots", "int64", ("candidates",)),  # only its length matters: top-k/top-p candidates
)
STEP_INPUTS = (
    TensorSpec("block", "int64", ("batch", "verify")),  # [last emitted token, drafts...] at positions start..
    TensorSpec("start", "int64", ("batch",)),
    TensorSpec("slots", "int64", ("batch",)),  # each row's slot in the state pool
    TensorSpec("visible_rows", "int64", ("rows",)),  # only its length matters: R >= max(start)
    TensorSpec("uniforms", "float32", ("batch", "verify")),
)
STEP_OUTPUTS = (
    TensorSpec("target_tokens", "int64", ("batch", "verify")),  # the target's choice at every slot
    TensorSpec("accept_len", "int64", ("batch",)),  # accepted drafts: emit target_tokens[:, :accept_len + 1]
    TensorSpec("next_block", "int64", ("batch", "next")),  # [bonus token, drafts...] at next_start: 1 + len(draft_slots)
    TensorSpec("next_start", "int64", ("batch",)),
)
DRAFT_INPUTS = (TensorSpec("draft_slots", "int64", ("drafts",)),)  # only its length matters: drafts to compute
PREFILL_INPUTS = (
    TensorSpec("input_ids", "int64", ("batch", "prompt")),  # at positions start..start+P-1
    *STEP_INPUTS[1:4],  # start, slots, visible_rows: the reused prefix's rows (start 0: none)
    TensorSpec("uniforms", "float32", ("batch", "1")),
)
PREFILL_OUTPUTS = (TensorSpec("first_token", "int64", ("batch",)), TensorSpec("next_block", "int64", ("batch", "next")))

# Which owners' states a graph reads from the pool and which it returns rows of.
READS = {"prefill": ("target", "draft"), "step": ("target", "draft"), "verify": ("target",), "decode": ("target",)}
WRITES = {"prefill": ("target", "draft"), "step": ("target", "draft"), "verify": ("target", "draft"), "decode": ("target",)}


def owner(state: StateSpec) -> str:
    return state.name.split("_", 1)[0]


POOL_AXIS = {"positional": "pool_rows", "recurrent": "pool_slots"}  # flat: layers x slots (x positions)


def pool_view_shape(state: StateSpec) -> tuple[int, ...]:
    """The trailing shape of a state as graphs take it: positional [L * N * T, *row], recurrent [L * N, *shape]."""
    return state.shape[1:] if state.kind == "positional" else state.shape


def graph_inputs(graph: str, states: tuple[StateSpec, ...]) -> tuple[TensorSpec, ...]:
    fixed = PREFILL_INPUTS if graph == "prefill" else STEP_INPUTS
    drafting = DRAFT_INPUTS if graph == "step" else ()
    read = tuple(
        TensorSpec(s.name, "state", (f"{owner(s)}_{POOL_AXIS[s.kind]}", *map(str, pool_view_shape(s))))
        for s in states
        if owner(s) in READS[graph]
    )
    return (*fixed, *drafting, *SAMPLING, *read)


def graph_outputs(graph: str, states: tuple[StateSpec, ...]) -> tuple[TensorSpec, ...]:
    fixed = PREFILL_OUTPUTS if graph == "prefill" else STEP_OUTPUTS
    length = "prompt" if graph == "prefill" else "verify"
    per_row = {"positional": (length,), "recurrent": ()}  # a recurrent state returns its new value, not rows
    written = tuple(
        TensorSpec(f"{s.name}_rows", "state", (str(s.layers), "batch", *per_row[s.kind], *map(str, pool_view_shape(s))))
        for s in states
        if owner(s) in WRITES[graph]
    )
    return (*fixed, *written)


class StepOutput(NamedTuple):
    """What a step-like graph returns (prefill too: its first token is target_tokens[:, 0], accept_len 0)."""

    target_tokens: torch.Tensor  # [B, V]
    accept_len: torch.Tensor  # [B]
    next_block: torch.Tensor  # [B, N]
    next_start: torch.Tensor  # [B]
    rows: dict[str, torch.Tensor]  # state name -> [layers, B, V (or P), *row_shape]
