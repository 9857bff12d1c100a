"""Engines: a runner executes the graphs (torch modules, ONNX Runtime sessions, TensorRT plans); `GraphEngine`
owns the state pool around it and is what the scheduler calls.

Per call the engine passes the whole pool (runners bind it without copying) with each row's slot, and writes
the rows the graph returns at their (slot, position). The host never touches tensors beyond the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from dflash_trt.runtime.cuda_graphs import CAPTURED_GRAPHS, BatchPadding, CudaGraphCalls
from dflash_trt.runtime.graph_io import GRAPH_NAMES, graph_inputs, graph_outputs, pool_view_shape
from dflash_trt.runtime.prefixes import SlotPrefixes
from dflash_trt.runtime.sampling import SamplingParams, SamplingTensors
from dflash_trt.runtime.states import DTYPES, StatePool, StateSpec

ROW_BUCKET = 64  # past rows are read in multiples of this: fewer distinct shapes, so runners re-plan less often


@dataclass(frozen=True)
class EngineSpec:
    """What the host needs to know about a built pair (stored in the engine manifest)."""

    block_size: int
    max_seq_len: int
    max_batch_size: int
    vocab_size: int
    mask_token_id: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    states: tuple[StateSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "max_seq_len": self.max_seq_len,
            "max_batch_size": self.max_batch_size,
            "vocab_size": self.vocab_size,
            "mask_token_id": self.mask_token_id,
            "dtype": self.dtype,
            "states": [s.to_json() for s in self.states],
        }

    @staticmethod
    def from_json(record: dict[str, Any]) -> EngineSpec:
        if "states" not in record:
            raise ValueError("this engine was built by an older dflash-trt (no state description): rebuild it with dflash-build")
        states = tuple(StateSpec.from_json(s) for s in record["states"])
        fields = {k: v for k, v in record.items() if k != "states"}
        return EngineSpec(**fields, states=states)

    @property
    def positions(self) -> int:
        """Rows per sequence of positional states: max_seq_len + block_size (a verify block may write past the end)."""
        return self.max_seq_len + self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class GraphRunner(Protocol):
    """Executes the graphs of a built pair: named inputs (graph_io) -> named outputs."""

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class TorchRunner:
    """The graph bodies (methods of a torch module) run on `device`: the reference on the CPU, the `torch-cuda`
    backend on a GPU, where the batched graphs are padded to a bucket of rows and captured as CUDA graphs per input
    shape and replayed (`cuda_graphs`; prefill's shapes follow each prompt's length: it runs eagerly). Inputs move to
    the device (the pool's states are there already); the rows a graph computes for the pool stay there, every other
    output comes back to the CPU for the scheduler."""

    def __init__(self, graphs: Any, spec: EngineSpec, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.graphs = graphs.eval().to(self.device)
        self.names = {
            g: ([t.name for t in graph_inputs(g, spec.states)], [t.name for t in graph_outputs(g, spec.states)])
            for g in GRAPH_NAMES
        }
        self.cuda_graphs = CudaGraphCalls(self.device) if self.device.type == "cuda" else None  # None: eager
        self.padding = {g: BatchPadding.of(g, spec.states, spec.max_batch_size) for g in CAPTURED_GRAPHS}

    @torch.inference_mode()
    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        body: Callable[..., tuple[torch.Tensor, ...]] = getattr(self.graphs, graph)
        input_names, output_names = self.names[graph]
        values = [inputs[name] for name in input_names]
        if self.cuda_graphs is not None and graph in CAPTURED_GRAPHS:
            outputs = self.cuda_graphs.run(graph, body, values, self.padding[graph])
        else:
            outputs = body(*(v.to(self.device) for v in values))
        return {name: value if name.endswith("_rows") else value.cpu() for name, value in zip(output_names, outputs, strict=True)}


@dataclass(frozen=True)
class StepBatch:
    """One batched call: row b is the sequence in pool slot slots[b]."""

    slots: torch.Tensor  # [B]
    block: torch.Tensor  # [B, V]: [last emitted token, drafts to verify...] at positions start..start+V-1
    start: torch.Tensor  # [B]
    uniforms: torch.Tensor  # [B, V] float32: the uniform of each slot's token
    sampling: SamplingTensors
    drafts: int = 0  # "step" only: drafts to compute for the next block (1 .. block_size - 1)


@dataclass(frozen=True)
class PrefillRow:
    """One sequence of a prefill call: its prompt from position `start` on (rows < start: a prefix the slot holds)."""

    slot: int
    tokens: list[int]
    uniform: float  # of its first token
    sampling: SamplingParams
    start: int = 0


@dataclass(frozen=True)
class StepResult:
    target_tokens: torch.Tensor  # [B, V]: emit slots 0..accept_len
    accept_len: torch.Tensor  # [B]: accepted drafts (emitted = accept_len + 1)
    next_block: torch.Tensor  # [B, N]: [last emitted token, drafts...]
    next_start: torch.Tensor  # [B]: position of next_block[:, 0]


class GraphEngine:
    """A state pool for `max_batch` sequences + a graph runner: the prefill and step calls of the scheduler."""

    def __init__(
        self, runner: GraphRunner, spec: EngineSpec, max_batch: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        if spec.block_size < 2:
            raise ValueError(f"block_size={spec.block_size} must be at least 2 (the last token plus one draft slot)")
        self.runner, self.spec = runner, spec
        self.block_size, self.max_seq_len, self.vocab_size = spec.block_size, spec.max_seq_len, spec.vocab_size
        self.pool = StatePool(spec.states, max_batch or spec.max_batch_size, device)  # where the runner computes
        self._carriers: dict[int, torch.Tensor] = {}
        self._flat_states = {s.name: self.pool.tensors[s.name].view(-1, *pool_view_shape(s)) for s in spec.states}  # graph form
        self._input_names = {graph: {t.name for t in graph_inputs(graph, spec.states)} for graph in GRAPH_NAMES}
        self.recurrent = any(s.kind == "recurrent" for s in spec.states)  # they hold a slot's whole sequence
        self.prefixes = SlotPrefixes(whole=self.recurrent)  # the prompt rows each slot still holds
        self.reuse_prefixes = True  # whether `acquire` starts a prompt after a prefix a slot holds

    def acquire(self, prompt: list[int], scope: Hashable = None) -> tuple[int, int]:
        """A free slot for `prompt` -> (slot, start): the slot already holds the rows of the prompt's first `start`
        tokens (a prefix shared with a prompt of the same `scope` prefilled earlier, copied from that prompt's slot
        unless the slot is that one), so `prefill` computes prompt[start:]. On targets with recurrent states, only a
        slot's whole sequence is reused (`SlotPrefixes`). Raises NoFreeSlot."""
        if not self.reuse_prefixes:
            return self.pool.acquire(), 0
        donor, shared = self.prefixes.longest(prompt, scope)
        free = self.pool.free_slot_ids
        # the donor itself if it is free (nothing to copy), else the free slot holding the least (kept longest)
        slot = self.pool.acquire(preferred=donor if donor in free else min(free, key=self.prefixes.held, default=-1))
        self.prefixes.enter(slot, scope)
        if shared and slot != donor:
            self.copy_prefix(donor, slot, shared)
        self.prefixes.written(slot, shared, shared)  # rows from `shared` on are the new prompt's: reused by no one now
        return slot, shared

    def reusable(self, prompt: list[int], scope: Hashable = None) -> int:
        """How many leading tokens of `prompt` `acquire` would find in a slot now (0 with reuse off)."""
        return self.prefixes.longest(prompt, scope)[1] if self.reuse_prefixes else 0

    def reusable_after(self, earlier: Sequence[int], prompt: list[int]) -> int:
        """How many leading tokens of `prompt` `acquire` would find in the slot of a prompt `earlier` of the same scope
        once that is prefilled (0 with reuse off)."""
        return self.prefixes.offers(earlier, prompt) if self.reuse_prefixes else 0

    def prefill(self, rows: list[PrefillRow]) -> StepResult:
        """Each row's prompt tokens from its `start` on into its pool slot, in one call (every row the same number of
        tokens) -> [B] first tokens (target_tokens[:, 0]) and first draft blocks. Rows < start of a slot must hold the
        prompt's first `start` tokens' states (a reused prefix, `copy_prefix`), and on targets with recurrent states
        the slot's sequence must end there."""
        for row in rows:
            self.prefixes.check_start(row.slot, row.start)
        out = self._prefill_call(rows)
        for row in rows:
            self.prefixes.prefilled(row.slot, row.start, row.tokens)
        return out

    def catch_up(self, rows: list[PrefillRow]) -> StepResult:
        """Rows of a sequence's own tokens at positions start.. recomputed by the prefill graph, which writes every
        state's rows, the drafter's context too: what `decode` steps leave unwritten. Each row's tokens end with its
        next block's first token (the last emitted) -> the next token and a whole draft block, as a step verifying
        nothing would give (every row the same number of tokens). Rows < start must hold every state's rows. Raises
        ValueError on a target with recurrent states, which have taken in those tokens already (recomputing them
        would take them in twice): there plain stretches run `verify`, which keeps the drafter's context."""
        if self.recurrent:
            raise ValueError("catch_up: this target's recurrent states have taken in the tokens; run `verify`, not `decode`")
        out = self._prefill_call(rows)
        for row in rows:
            self.prefixes.written(row.slot, row.start, row.start + len(row.tokens))
        return out

    def _prefill_call(self, rows: list[PrefillRow]) -> StepResult:
        """One prefill graph call over the rows, their computed rows written into the pool."""
        length = len(rows[0].tokens)
        if any(len(row.tokens) != length for row in rows):
            raise ValueError(f"prefill rows of {sorted({len(r.tokens) for r in rows})} tokens: one call prefills equal lengths")
        slots, start = torch.tensor([r.slot for r in rows]), torch.tensor([r.start for r in rows])  # [B]
        inputs = {
            "input_ids": torch.tensor([r.tokens for r in rows], dtype=torch.long),  # [B, P]
            "start": start,
            "slots": slots,
            "visible_rows": self._carrier(max(1, *(r.start for r in rows))),  # exactly the longest prefix: R + P rows read
            "uniforms": torch.tensor([[r.uniform] for r in rows], dtype=torch.float32),  # [B, 1]
            **SamplingTensors.of([r.sampling for r in rows], self.vocab_size).as_inputs(),
            **self._flat_states,
        }
        out = self.runner.run("prefill", {k: v for k, v in inputs.items() if k in self._input_names["prefill"]})
        self._write_rows(out, slots, start[:, None] + torch.arange(length)[None, :])
        accepted = torch.zeros(len(rows), dtype=torch.long)
        return StepResult(out["first_token"][:, None], accepted, out["next_block"], start + length)

    def copy_prefix(self, source: int, target: int, rows: int) -> None:
        """Copy the states of the first `rows` tokens of slot `source` into slot `target` (`StatePool.copy_sequence`):
        a shared prompt prefix, so that the target slot's `prefill` starts at `rows`."""
        self.pool.copy_sequence(source, target, rows)
        self.prefixes.copy(source, target, rows)

    def run(self, graph: str, batch: StepBatch) -> StepResult:
        """graph: "step" | "verify" | "decode" over the batch's slots; writes the computed rows into the pool."""
        out = self.call(graph, batch)
        return StepResult(out["target_tokens"], out["accept_len"], out["next_block"], out["next_start"])

    def call(self, graph: str, batch: StepBatch) -> dict[str, torch.Tensor]:
        """`run`, returning every output the runner gave (a runner may give more than the graph schema's)."""
        visible = self._visible_rows(int(batch.start.max()), batch.block.shape[1])
        inputs = {
            "draft_slots": self._carrier(max(batch.drafts, 1)),
            "block": batch.block,
            "start": batch.start,
            "slots": batch.slots,
            "visible_rows": visible,
            "uniforms": batch.uniforms,
            **batch.sampling.as_inputs(),
            **self._flat_states,
        }
        out = self.runner.run(graph, {k: v for k, v in inputs.items() if k in self._input_names[graph]})
        positions = batch.start[:, None] + torch.arange(batch.block.shape[1])  # [B, V]
        self._write_rows(out, batch.slots, positions)
        for slot, first, end in zip(batch.slots.tolist(), batch.start.tolist(), out["next_start"].tolist(), strict=True):
            self.prefixes.written(slot, first, end)
        return out

    def _visible_rows(self, largest_start: int, width: int) -> torch.Tensor:
        """A shape carrier of length R >= largest_start, rounded up to ROW_BUCKET, with R + width <= the pool's
        positions: graphs read R + width rows of a slot (the past, then room for the block's keys)."""
        rounded = -(-max(largest_start, 1) // ROW_BUCKET) * ROW_BUCKET
        return self._carrier(min(rounded, self.spec.positions - width))

    def _carrier(self, length: int) -> torch.Tensor:
        """An int64 tensor whose length is the value a graph reads from it (kept: made once per length)."""
        if length not in self._carriers:
            self._carriers[length] = torch.empty(length, dtype=torch.long)
        return self._carriers[length]

    def _write_rows(self, out: dict[str, torch.Tensor], slots: torch.Tensor, positions: torch.Tensor) -> None:
        for state in self.spec.states:
            rows = out.get(f"{state.name}_rows")
            if rows is None:
                continue
            if state.kind == "positional":
                self.pool.write_rows(state.name, slots, positions, rows)
            else:
                self.pool.write_values(state.name, slots, rows)
