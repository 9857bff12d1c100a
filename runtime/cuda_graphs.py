"""CUDA graphs for the GPU runners (torch-cuda, TensorRT): each (graph, input shapes) is captured once and replayed, so a batched
step launches its few hundred kernels as one graph instead of one by one from Python.

A captured call keeps device buffers for the inputs the host sends (tokens, positions, sampling parameters, shape
carriers), copies each call's values into them and replays; the state pool's tensors are captured in place (the
engine allocates them once). Outputs are the capture's own tensors, which the next replay of any call may
overwrite (captures share one memory pool, as calls never run at the same time): the runner copies them to the
host or into the pool before it replays again. A shape is captured at its second call (a capture costs about two
calls: a shape used once is not worth it), and the least recently used captures are dropped beyond `capacity`.

Calls are padded to a bucket of rows first (`BatchPadding`: 1, 2, 4, 8, then multiples of 8, as vLLM's capture
sizes, at most the build's batch limit), repeating their first row: a batch of 5 replays the capture of 8, one of 13
that of 16. Shapes multiply (rows x verify width x context bucket), and without buckets a server whose batch moves
between 1 and 64 would capture each batch size at every width and context it meets (59 captures in an 8-client run
at 8B size) and keep recapturing past `capacity`.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from dflash_trt.runtime.graph_io import graph_inputs, graph_outputs
from dflash_trt.runtime.states import StateSpec

CAPTURED_GRAPHS = ("step", "verify", "decode")  # prefill's shapes follow each prompt's length: it runs eagerly
GraphBody = Callable[..., tuple[torch.Tensor, ...]]
CallKey = tuple[object, ...]
Outputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class BatchPadding:
    """Pads a graph's batched call to a bucket of rows and cuts its outputs back. The padding rows repeat the first
    row (a valid slot, position and parameters: they read what it reads), and their outputs are cut off before the
    engine writes any row into the pool, so they change nothing; each real row's result is computed as in the unpadded
    call, the batch shape aside. A padding row is greedy even where the first row samples (it is not among
    `sampled_rows`)."""

    input_axes: tuple[int | None, ...]  # each input's batch axis (None: it has none)
    output_axes: tuple[int | None, ...]
    limit: int  # rows a call may have (the build's batch limit): buckets stop there

    @classmethod
    def of(cls, graph: str, states: tuple[StateSpec, ...], limit: int) -> BatchPadding:
        def axis(axes: tuple[str, ...]) -> int | None:
            return axes.index("batch") if "batch" in axes else None

        inputs = tuple(axis(t.axes) for t in graph_inputs(graph, states))
        return cls(inputs, tuple(axis(t.axes) for t in graph_outputs(graph, states)), limit)

    def bucket(self, rows: int) -> int:
        """Rows padded to: the next power of two up to 8, else the next multiple of 8 (at most 7 padding rows, whose
        attention reads cost what a row's does); at most `limit`, never fewer than `rows`."""
        bucket = 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8
        return max(rows, min(bucket, self.limit))

    def call(self, run: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]], values: Sequence[torch.Tensor]) -> Outputs:
        """`run` on `values` padded to their bucket (the first row repeated) -> its outputs' real rows (views)."""
        rows = next(v.shape[a] for v, a in zip(values, self.input_axes, strict=True) if a is not None)
        bucket = self.bucket(rows)
        padded = [v if a is None else _repeat_first(v, a, bucket) for v, a in zip(values, self.input_axes, strict=True)]
        outputs = run(padded)
        return tuple(o if a is None else o.narrow(a, 0, rows) for o, a in zip(outputs, self.output_axes, strict=True))


def _repeat_first(value: torch.Tensor, axis: int, rows: int) -> torch.Tensor:
    extra = rows - value.shape[axis]
    if extra == 0:
        return value
    first = value.narrow(axis, 0, 1)
    return torch.cat([value, first.expand(*(extra if d == axis else -1 for d in range(value.dim())))], dim=axis)


@dataclass(frozen=True)
class CapturedCall:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # device buffers of host inputs; the pool's tensors themselves
    outputs: tuple[torch.Tensor, ...]


class CudaGraphCalls:
    """Replays captured CUDA graphs of graph bodies on `device`; `run` falls back to eager calls for good (with a
    message) if a capture fails."""

    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.capacity = capacity
        self.enabled = True
        self.captures = 0  # how many calls were captured (a replay of a new shape costs one capture)
        self._calls: OrderedDict[CallKey, CapturedCall] = OrderedDict()
        self._seen: set[CallKey] = set()  # shapes called once, eagerly
        self._memory = torch.cuda.graph_pool_handle()

    def run(self, name: str, body: GraphBody, values: Sequence[torch.Tensor], padding: BatchPadding) -> Outputs:
        """`body(*values)`, padded to its bucket of rows (`padding`), as a replay of that shape's capture or eagerly."""
        return padding.call(lambda padded: self._replay(name, body, padded), values)

    def _replay(self, name: str, body: GraphBody, values: Sequence[torch.Tensor]) -> Outputs:
        call = self._captured(name, body, values) if self.enabled else None
        if call is None:
            return body(*(v.to(self.device) for v in values))
        for buffer, value in zip(call.inputs, values, strict=True):
            if buffer is not value:
                buffer.copy_(value, non_blocking=True)
        call.graph.replay()
        return call.outputs

    def _captured(self, name: str, body: GraphBody, values: Sequence[torch.Tensor]) -> CapturedCall | None:
        """The capture of this call's shapes, made at their second call; None at the first, or if capturing fails."""
        key = self._key(name, values)
        if key in self._calls:
            self._calls.move_to_end(key)
            return self._calls[key]
        if key not in self._seen:
            if len(self._seen) >= 16 * self.capacity:  # bounded: forgetting a shape costs one more eager call
                self._seen.clear()
            self._seen.add(key)
            return None
        try:
            call = self._capture(body, values)
        except RuntimeError as error:  # an op that cannot be captured: this runner stays eager
            self.enabled = False
            print(f"dflash: CUDA graph capture of {name} failed, running eagerly from now on: {error}", file=sys.stderr)
            return None
        self._calls[key] = call
        if len(self._calls) > self.capacity:
            self._calls.popitem(last=False)
        return call

    def _key(self, name: str, values: Sequence[torch.Tensor]) -> CallKey:
        """Shapes and dtypes of every input, and the address of each already on the device (the pool's tensors)."""
        resident = (v.data_ptr() if v.device == self.device else 0 for v in values)
        return (name, *((tuple(v.shape), v.dtype, address) for v, address in zip(values, resident, strict=True)))

    def _capture(self, body: GraphBody, values: Sequence[torch.Tensor]) -> CapturedCall:
        inputs = tuple(v if v.device == self.device else v.to(self.device, copy=True).contiguous() for v in values)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture: lazy initialisation (cuBLAS handles, plans)
            body(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            outputs = body(*inputs)
        self.captures += 1
        return CapturedCall(graph, inputs, tuple(outputs))
