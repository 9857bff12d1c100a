"""What the linear layers' inputs look like on real text: the statistics TensorRT's quantized forms are set from
(`qdq.py`: FP8 activation scales, AWQ's per-channel weight scales).

The text is the toolkit's own Python sources (code and prose in docstrings; shipped with every install, never
downloaded, and not the held-out text `dflash-quality` measures on, which is docs/). Windows of it go through the
pair's torch engine as DFlash runs them: a prefill, then a few verify steps with the drafter's blocks, so the target's
layers see prompt and block rows and the drafter's layers see their own inputs. Forward hooks on every `nn.Linear`
record each layer's input: its largest magnitude, its mean magnitude per channel, and a sample of rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # the networks (and the plugins they import) only where calibration runs, not where it is read
    from dflash_trt.builder.networks import DrafterNetwork, TargetNetwork

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CALIBRATION_SOURCES = ("builder", "runtime")  # directories of the package whose .py files are the text
SAMPLE_ROWS = 256  # input rows kept per layer (AWQ's scale search runs on them)
WINDOWS, WINDOW_TOKENS, NEW_TOKENS = 8, 128, 32


@dataclass
class LinearInputs:
    """One linear layer's inputs over the calibration run."""

    amax: float = 0.0  # largest |x|
    abs_sum: torch.Tensor | None = None  # [K] sum of |x| per input channel
    rows: int = 0
    sample: torch.Tensor | None = None  # [<= SAMPLE_ROWS, K] rows drawn uniformly from all seen (reservoir)
    searched: dict[tuple[tuple[str, ...], int], torch.Tensor] = field(default_factory=dict)  # AWQ scales found, by group
    _generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0), repr=False)

    def add(self, x: torch.Tensor) -> None:
        """x: [..., K] one call's input."""
        rows = x.detach().reshape(-1, x.shape[-1]).float()  # [R, K]
        self.amax = max(self.amax, float(rows.abs().max()))
        total = rows.abs().sum(0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self._sample_rows(rows)
        self.rows += rows.shape[0]

    def _sample_rows(self, rows: torch.Tensor) -> None:
        """Reservoir sampling (algorithm R, seeded): the n-th row seen replaces a kept row with probability
        SAMPLE_ROWS / n, so the kept rows are spread over the whole run, not its first window."""
        kept = 0 if self.sample is None else self.sample.shape[0]
        fill = min(SAMPLE_ROWS - kept, rows.shape[0])
        self.sample = rows[:fill].clone() if self.sample is None else torch.cat([self.sample, rows[:fill]])
        seen = torch.arange(self.rows + fill, self.rows + rows.shape[0]) + 1  # 1-based index of each later row
        slot = (torch.rand(seen.shape[0], generator=self._generator) * seen).long()  # uniform in [0, n)
        chosen = slot < SAMPLE_ROWS
        self.sample[slot[chosen]] = rows[fill:][chosen]

    @property
    def mean_abs(self) -> torch.Tensor:
        """[K] mean |x| per input channel."""
        assert self.abs_sum is not None
        return self.abs_sum / self.rows

    @property
    def rows_sample(self) -> torch.Tensor:
        """[r, K] the kept rows."""
        assert self.sample is not None
        return self.sample


def parameter_name(module_path: str) -> str:
    """The name the ONNX exporter gives a linear layer's weight (`target.layers.0.mlp.up_proj` ->
    `p_target_layers_0_mlp_up_proj_weight`), which each MatMul node records in its metadata."""
    return "p_" + module_path.replace(".", "_") + "_weight"


def calibration_windows(tokenizer: Any, count: int = WINDOWS, length: int = WINDOW_TOKENS) -> list[list[int]]:
    """`count` windows of `length` token ids from the toolkit's own sources, spread over them (sorted, so the
    same install gives the same windows)."""
    files = sorted(p for directory in CALIBRATION_SOURCES for p in (PACKAGE_ROOT / directory).glob("*.py"))
    ids: list[int] = []
    for path in files:
        ids.extend(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    stride = max(length, (len(ids) - length) // count)
    windows = [ids[start : start + length] for start in range(0, max(1, len(ids) - length + 1), stride)][:count]
    if not windows or len(windows[0]) < length:
        raise ValueError(f"the calibration text gave {len(ids)} tokens, fewer than one window of {length}")
    return windows


def collect_linear_inputs(
    target: TargetNetwork, drafter: DrafterNetwork, windows: list[list[int]], block_size: int, new_tokens: int = NEW_TOKENS
) -> dict[str, LinearInputs]:
    """Run each window through the pair as DFlash does (prefill, then greedy verify steps) and record the input of
    every linear layer, by the exported name of its weight (`parameter_name`)."""
    from dflash_trt.builder.graphs import torch_engine
    from dflash_trt.runtime.loop import generate

    seen: dict[str, LinearInputs] = {}
    hooks = []
    for prefix, network in (("target", target), ("drafter", drafter)):
        for path, module in network.named_modules():
            if isinstance(module, nn.Linear):
                record = seen.setdefault(parameter_name(f"{prefix}.{path}"), LinearInputs())
                hooks.append(module.register_forward_pre_hook(lambda _, args, record=record: record.add(args[0])))
    fc, context_kv = seen[parameter_name("drafter.fc")], drafter.context_kv  # the HiddenStateTap op applies fc itself

    def recorded_context_kv(taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fc.add(taps)
        return context_kv(taps, positions)

    drafter.context_kv = recorded_context_kv  # type: ignore[method-assign]  # this instance, until the finally below
    longest = max(len(w) for w in windows) + new_tokens + block_size
    engine = torch_engine(target, drafter, min(longest, target.config.max_position_embeddings), block_size)
    try:
        with torch.no_grad():
            for index, window in enumerate(windows):
                print(f"[dflash-build]   calibration window {index + 1}/{len(windows)}", file=sys.stderr)
                generate(engine, window, new_tokens)
    finally:
        for hook in hooks:
            hook.remove()
        del drafter.context_kv
    return {name: record for name, record in seen.items() if record.rows}
