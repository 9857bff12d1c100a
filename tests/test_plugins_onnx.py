"""The dflash:: ops in ONNX: nodes in domain `dflash` whose model-local function bodies ONNX Runtime runs,
equal to the torch reference semantics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from dflash_trt.builder.layers import rotary_cos_sin
from dflash_trt.builder.networks import DrafterNetwork, StackedPast, load_drafter, load_target
from dflash_trt.builder.tiny_checkpoints import write_tiny_drafter
from dflash_trt.plugins import block_denoise, causal_conv1d, hidden_state_tap
from dflash_trt.plugins.onnx_domain import DOMAIN, ONNX_OPSET, attach_functions
from torch import nn

TOLERANCE = 1e-5  # fp32, max abs difference of drafter hidden states (values of magnitude ~1)


class DraftFromTaps(nn.Module):
    """Taps of context positions 0..T-1 -> HiddenStateTap -> every drafter layer's BlockDenoise -> hidden."""

    def __init__(self, drafter: DrafterNetwork) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(
        self, taps: torch.Tensor, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_len: torch.Tensor
    ) -> torch.Tensor:
        ctx_positions = torch.arange(taps.shape[1]).expand(taps.shape[0], -1)  # [B, T]
        ctx_k, ctx_v = self.drafter.context_kv(taps, ctx_positions)  # [L, B, T, Hkv, D]
        return self.drafter(block_embeds, block_positions, ctx_k, ctx_v, ctx_len)


def _export(drafter: DrafterNetwork, path: Path) -> onnx.ModelProto:
    n_features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    example = (
        torch.randn(2, 20, n_features),
        torch.randn(2, 16, 64),
        torch.tensor([[20 + i for i in range(16)]] * 2),
        torch.tensor([20, 17]),
    )
    batch, ctx, block = torch.export.Dim("batch"), torch.export.Dim("ctx"), torch.export.Dim("block", min=2, max=16)
    program = torch.onnx.export(
        DraftFromTaps(drafter).eval(),
        example,
        dynamo=True,
        opset_version=ONNX_OPSET,
        dynamic_shapes=({0: batch, 1: ctx}, {0: batch, 1: block}, {0: batch, 1: block}, {0: batch}),
    )
    model = attach_functions(program.model_proto, [*hidden_state_tap.ONNX_FUNCTIONS, *block_denoise.ONNX_FUNCTIONS])
    onnx.save(model, path)
    return model


@pytest.mark.parametrize("variant", ["bidirectional", "sliding-window"])
def test_plugins_run_in_onnxruntime_and_match_reference(variant: str, tiny_targets: dict[str, Path], tmp_path: Path) -> None:
    overrides = (
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5} if variant == "sliding-window" else {}
    )
    drafter = load_drafter(write_tiny_drafter(tiny_targets["llama"], tmp_path / "d", **overrides))
    model = _export(drafter, tmp_path / "draft.onnx")

    onnx.checker.check_model(model, full_check=True)
    dflash_nodes = [n.op_type for n in model.graph.node if n.domain == DOMAIN]
    assert dflash_nodes.count("HiddenStateTap") == 1
    assert dflash_nodes.count("BlockDenoise") == drafter.config.num_layers
    assert {f.name for f in model.functions if f.domain == DOMAIN} >= {"HiddenStateTap", "BlockDenoise"}
    max_blocks = {a.i for n in model.graph.node if n.op_type == "BlockDenoise" for a in n.attribute if a.name == "max_block"}
    assert max_blocks == {drafter.config.block_size}, "compiled kernels are sized for the drafter's block"

    session = ort.InferenceSession(str(tmp_path / "draft.onnx"), providers=["CPUExecutionProvider"])
    torch.manual_seed(21)
    n_features = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    for batch, ctx, size in [(1, 7, 16), (3, 33, 3)]:  # shapes other than the traced ones; the first 3 slots
        taps, embeds = torch.randn(batch, ctx, n_features), torch.randn(batch, size, 64)
        ctx_len = torch.randint(1, ctx + 1, (batch,))
        positions = ctx_len[:, None] + torch.arange(size)
        feeds = dict(
            zip([i.name for i in session.get_inputs()], [t.numpy() for t in (taps, embeds, positions, ctx_len)], strict=True)
        )
        (actual,) = session.run(None, feeds)
        with torch.no_grad():
            expected = DraftFromTaps(drafter)(taps, embeds, positions, ctx_len).numpy()
        assert np.abs(actual - expected).max() <= TOLERANCE


def test_rope_helper_is_what_the_function_body_computes() -> None:
    """HiddenStateTap's body builds cos/sin from positions x inv_freq, duplicated halves, like rotary_cos_sin."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    cos, _ = rotary_cos_sin(inv_freq, 1.0, torch.tensor([[3]]), torch.float32)
    assert torch.allclose(cos[0, 0], torch.cos(torch.tensor(3.0) * torch.cat([inv_freq, inv_freq])))


class TargetLogitsAndTaps(nn.Module):
    """The target network as exported inside the fused graphs, with its logits and taps as outputs."""

    def __init__(self, target: nn.Module) -> None:
        super().__init__()
        self.target = target

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        out = self.target(input_ids, positions, StackedPast(past_k, past_v))
        return out.logits, out.taps


def test_target_logits_and_taps_in_onnxruntime_match_torch(tiny_targets: dict[str, Path], tmp_path: Path) -> None:
    target = load_target(tiny_targets["qwen3"], tap_layer_ids=(1, 3, 5))
    shape = (6, 2, 9, 2, 24)  # [L, B, T, Hkv, D]
    example = (
        torch.ones(2, 16, dtype=torch.long),
        torch.tensor([[9 + i for i in range(16)]] * 2),
        torch.zeros(shape),
        torch.zeros(shape),
    )
    batch, rows = torch.export.Dim("batch"), torch.export.Dim("rows", min=2)
    axes = ({0: batch}, {0: batch}, {1: batch, 2: rows}, {1: batch, 2: rows})
    program = torch.onnx.export(
        TargetLogitsAndTaps(target).eval(), example, dynamo=True, opset_version=ONNX_OPSET, dynamic_shapes=axes
    )
    program.save(str(tmp_path / "target.onnx"))
    session = ort.InferenceSession(str(tmp_path / "target.onnx"), providers=["CPUExecutionProvider"])
    torch.manual_seed(5)
    inputs = (
        torch.randint(0, 96, (1, 16)),
        torch.arange(30, 46)[None],
        torch.randn(6, 1, 30, 2, 24),
        torch.randn(6, 1, 30, 2, 24),
    )
    actual = session.run(None, dict(zip([i.name for i in session.get_inputs()], [t.numpy() for t in inputs], strict=True)))
    with torch.no_grad():
        expected = TargetLogitsAndTaps(target)(*inputs)
    for got, want in zip(actual, expected, strict=True):
        assert np.abs(got - want.numpy()).max() <= 1e-4


class ConvOverBlock(nn.Module):
    """dflash::CausalConv1d alone: the Gated DeltaNet conv of a block after a window."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) * 0.5)

    def forward(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d.causal_conv1d(x, window, self.weight)


def test_causal_conv1d_runs_in_onnxruntime_and_matches_reference(tmp_path: Path) -> None:
    """Its ONNX body (Concat, Conv with group = channels, x * Sigmoid(x)) in ONNX Runtime at token counts other than
    the traced one: outputs within fp32 rounding of the reference, the extended window exact."""
    torch.manual_seed(3)
    module = ConvOverBlock(channels=24, kernel=4).eval()
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    program = torch.onnx.export(
        module, (torch.randn(2, 5, 24), torch.randn(2, 3, 24)), dynamo=True, opset_version=ONNX_OPSET,
        dynamic_shapes=({0: batch, 1: tokens}, {0: batch}),
    )  # fmt: skip
    model = attach_functions(program.model_proto, causal_conv1d.ONNX_FUNCTIONS)
    assert [n.op_type for n in model.graph.node if n.domain == DOMAIN] == ["CausalConv1d"]
    onnx.save(model, tmp_path / "conv.onnx")
    session = ort.InferenceSession(str(tmp_path / "conv.onnx"), providers=["CPUExecutionProvider"])
    for rows, count in [(1, 1), (3, 16), (2, 23)]:
        x, window = torch.randn(rows, count, 24), torch.randn(rows, 3, 24)
        y, extended = session.run(None, {session.get_inputs()[0].name: x.numpy(), session.get_inputs()[1].name: window.numpy()})
        with torch.no_grad():
            ref_y, ref_extended = module(x, window)
        assert np.abs(y - ref_y.numpy()).max() <= TOLERANCE
        assert np.array_equal(extended, ref_extended.numpy())
