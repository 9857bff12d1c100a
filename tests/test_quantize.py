"""dflash-build --quantize: the graphs hold ONNX Runtime's quantized operator (not a float graph under a new name),
or TensorRT's Q/DQ forms as its operator pages document them, DFlash equals plain decoding on the same quantized
engine bit for bit (tokens and the K/V rows they leave), sampling through DFlash follows the quantized target's own
distribution, and bad modes fail at build time."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from dflash_trt.builder.calibration import LinearInputs
from dflash_trt.builder.cli import main as dflash_build
from dflash_trt.builder.models import SHIPPED_CONFIGS
from dflash_trt.builder.qdq import awq_scales, form_errors, int4_dequantized, quantize_qdq
from dflash_trt.builder.quantize import LM_HEAD_BITS, MODES, drafter_nodes, lm_head_nodes, rows_independent
from dflash_trt.builder.tensorrt_engine import plugin_ready_onnx
from dflash_trt.builder.tiny_checkpoints import write_tiny_tokenizer
from dflash_trt.runtime.graph_io import GRAPH_NAMES
from dflash_trt.runtime.loop import generate, generate_plain
from dflash_trt.runtime.quality import block_logits, logits_engine
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.scheduler import FixedVerify
from transformers import Qwen3Config

from tests.conftest import all_nodes
from tests.test_build import TENSORRT_OPS
from tests.test_sampling_lossless import NEW_TOKENS, PROMPT, SHARED, SLOTS, VOCAB, _chi_square_p, _dflash_counts, _pair


def _build(target: Path, drafter: Path, output: Path, *options: str) -> Path:
    command = ["--model", str(target), "--drafter", str(drafter), "--output", str(output), "--backend", "onnxruntime"]
    assert dflash_build([*command, *options]) == 0
    return output


# (target mode, drafter mode): each CPU mode for the target, and a drafter quantized on its own at other bits
BUILDS = [("int8", "int4"), ("int4", "int4")]
QDQ_BUILDS = [("fp8", "fp8"), ("int4-awq", "int4-awq")]  # TensorRT's forms, run here by ONNX Runtime


def _ids(builds: list[tuple[str, str]]) -> list[str]:
    return [f"{t}-drafter-{d}" for t, d in builds]


@pytest.fixture(scope="module")
def quantized_repo(
    request: pytest.FixtureRequest, tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[tuple[str, str], Path]:
    target_mode, drafter_mode = request.param
    output = tmp_path_factory.mktemp(f"quantized-{target_mode}-{drafter_mode}") / "repo"
    options = ("--max-seq-len", "256", "--quantize", target_mode, "--quantize-drafter", drafter_mode)
    return request.param, _build(tiny_targets["qwen3"], trained_drafter, output, *options)


@pytest.mark.parametrize("quantized_repo", BUILDS, ids=_ids(BUILDS), indirect=True)
def test_graphs_hold_quantized_operators(quantized_repo: tuple[tuple[str, str], Path], tiny_repo: Path) -> None:
    """Every linear layer with a constant weight is MatMulNBits at its side's bits: as many drafter-side layers at
    the drafter's bits as the float build of the same pair has outside the target's scope, LM heads at 8 bits."""
    (mode, drafter_mode), repo = quantized_repo
    engine_dir = repo / "dflash" / "1" / "engine"
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    record = manifest["quantization"]
    assert record["mode"] == mode and record["lm_head_bits"] == LM_HEAD_BITS
    assert record.get("drafter", record)["mode"] == drafter_mode
    vocab = manifest["engine"]["vocab_size"]
    for name in GRAPH_NAMES:
        model = onnx.load(str(engine_dir / f"{name}.onnx"), load_external_data=False)
        nodes = all_nodes(model.graph)
        weights = {tensor.name for tensor in model.graph.initializer if len(tensor.dims) == 2}
        assert [n.name for n in nodes if n.op_type == "MatMul" and n.input[1] in weights] == [], f"{name}: float linear layers"
        quantized = [n for n in nodes if n.op_type == "MatMulNBits"]
        assert quantized and all(n.domain == "com.microsoft" for n in quantized)
        # The LM head: the last vocab-wide matmul (a projection may be as wide, earlier) and those sharing its weight,
        # which weights.bin stores once (content-addressed: the same offset, for the target's and the drafter's copy).
        offset = {t.name: next((e.value for e in t.external_data if e.key == "offset"), t.name) for t in model.graph.initializer}
        float_graph = onnx.load(str(tiny_repo / "dflash" / "1" / "engine" / f"{name}.onnx"), load_external_data=False)
        heads = set(lm_head_nodes(float_graph))
        drafter_layers = len(set(drafter_nodes(float_graph)) - heads)
        head = offset[[n.input[1] for n in quantized if attribute(n, "N") == vocab][-1]]  # the last: an LM head
        bits = Counter((offset[n.input[1]] == head, attribute(n, "bits")) for n in quantized)
        expected = Counter({(True, LM_HEAD_BITS): len(heads)})
        expected[(False, MODES[mode].bits)] += len(quantized) - len(heads) - drafter_layers
        expected[(False, MODES[drafter_mode].bits)] += drafter_layers
        assert bits == +expected, f"{name}: (is LM head, bits) {bits}"
        assert {attribute(n, "accuracy_level") for n in quantized} == {4}
    quantized_bytes = (engine_dir / "weights.bin").stat().st_size
    assert quantized_bytes < (tiny_repo / "dflash" / "1" / "engine" / "weights.bin").stat().st_size


def attribute(node: onnx.NodeProto, name: str) -> int:
    return next(int(a.i) for a in node.attribute if a.name == name)


@pytest.mark.parametrize("quantized_repo", BUILDS + QDQ_BUILDS, ids=_ids(BUILDS + QDQ_BUILDS), indirect=True)
def test_dflash_equals_plain_decoding_bit_for_bit(quantized_repo: tuple[tuple[str, str], Path]) -> None:
    """Verifying whole blocks leaves the same tokens and the same target K/V rows as one-token plain decoding: each
    token's computation does not depend on the others in its call (int8-input kernels would amplify a 1-ulp
    difference into a different rounding, so an engine that is only approximately row-independent fails here)."""
    (mode, _), repo = quantized_repo
    if not rows_independent(MODES[mode], alone=2):
        pytest.xfail(
            f"on this CPU ONNX Runtime's {mode} kernels give rows other bits among 2 than among 16 rows, so "
            "verifying blocks cannot leave plain decoding's bits"
        )
    plain, _ = load_engine(repo, max_batch=1)
    # where the one-row kernel differs (AVX2, 4 bits), the runner runs one-row calls as two rows
    assert plain.runner.pad_single_rows == (not rows_independent(MODES[mode]))
    dflash, _ = load_engine(repo, max_batch=1)
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(1, 90, (12 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = generate_plain(plain, prompt, 48)
        result = generate(dflash, prompt, 48, policy=FixedVerify(dflash.block_size - 1))
        assert result.tokens == expected.tokens, f"prompt {seed}"
        accepted += result.stats.accepted_draft_tokens
        written = len(prompt) + len(expected.tokens) - 1  # the last token's rows are written by the next step
        for state in ("target_k", "target_v"):
            rows_plain = plain.pool.tensors[state][:, 0, :written]
            rows_dflash = dflash.pool.tensors[state][:, 0, :written]
            assert torch.equal(rows_plain, rows_dflash), (
                f"prompt {seed}: {state} differs by {(rows_plain - rows_dflash).abs().max()}"
            )
    assert accepted > 20, "drafts were hardly accepted: multi-token verify blocks were not exercised"


@pytest.mark.parametrize("quantized_repo", QDQ_BUILDS, ids=_ids(QDQ_BUILDS), indirect=True)
def test_tensorrt_forms_are_the_documented_qdq_patterns(quantized_repo: tuple[tuple[str, str], Path], tiny_repo: Path) -> None:
    """fp8 / int4-awq graphs: with the dflash function bodies stripped, only operators TensorRT's ONNX parser has;
    every Q/DQ node in a form its Quantize / Dequantize pages document (form_errors); every linear layer but the LM
    heads reads a dequantized weight of the mode's type; fp8 quantizes the layers' inputs, int4-awq does not."""
    (mode, _), repo = quantized_repo
    engine_dir = repo / "dflash" / "1" / "engine"
    record = json.loads((engine_dir / "manifest.json").read_text())["quantization"]
    assert record["mode"] == mode and record["operator"] == "QuantizeLinear / DequantizeLinear"
    stored = {"fp8": onnx.TensorProto.FLOAT8E4M3FN, "int4-awq": onnx.TensorProto.INT4}[mode]
    for name in GRAPH_NAMES:
        model = onnx.load(str(engine_dir / f"{name}.onnx"))
        assert form_errors(model) == [], name
        stripped = engine_dir.parent / f"{name}.plugins.onnx"
        plugin_ready_onnx(engine_dir / f"{name}.onnx", stripped)
        standard = {n.op_type for n in all_nodes(onnx.load(str(stripped), load_external_data=False).graph) if n.domain == ""}
        assert standard <= TENSORRT_OPS, f"{name}: operators TensorRT's parser lacks: {standard - TENSORRT_OPS}"
        weights = {t.name: t.data_type for t in model.graph.initializer}
        producers = {output: node for node in model.graph.node for output in node.output}
        float_graph = onnx.load(str(tiny_repo / "dflash" / "1" / "engine" / f"{name}.onnx"), load_external_data=False)
        linear = [n for n in model.graph.node if n.op_type == "MatMul" and (n.input[1] in weights or n.input[1].endswith("_dq"))]
        floating = [n for n in linear if n.input[1] in weights]
        assert len(floating) == len(lm_head_nodes(float_graph)), f"{name}: float linear layers besides the LM heads"
        for node in [n for n in linear if n.input[1] not in weights]:
            dequantize = producers[node.input[1]]
            assert dequantize.op_type == "DequantizeLinear" and weights[dequantize.input[0]] == stored, node.name
            assert producers[node.input[0]].op_type == ("DequantizeLinear" if mode == "fp8" else "Mul"), node.name
    assert (engine_dir / "weights.bin").stat().st_size < (tiny_repo / "dflash" / "1" / "engine" / "weights.bin").stat().st_size


def test_qdq_form_checker_sees_forms_tensorrt_does_not_parse() -> None:
    """form_errors, on one fp8 and one int4-awq layer: clean as built, and each planted violation is named."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=generator) * 0.05
    x = torch.randn(32, 128, generator=generator)
    calibration = {"p_probe_weight": LinearInputs()}
    calibration["p_probe_weight"].add(x)
    for mode in ("fp8", "int4-awq"):
        model = quantize_qdq(_one_layer(weight), {"linear": MODES[mode]}, calibration)
        assert form_errors(model) == [] and "MatMul" in {n.op_type for n in model.graph.node}
    broken = quantize_qdq(_one_layer(weight), {"linear": MODES["fp8"]}, calibration)
    zero = next(t for t in broken.graph.initializer if t.name.endswith("_fp8_zero"))
    zero.CopyFrom(onnx.helper.make_tensor(zero.name, onnx.TensorProto.FLOAT8E4M3FN, [], [1.0]))
    assert any("zero point" in error for error in form_errors(broken))
    scale = next(t for t in broken.graph.initializer if t.name == "x_fp8_scale")
    broken.graph.initializer.remove(scale)
    assert any("not a build-time constant" in error for error in form_errors(broken))


def _one_layer(weight: torch.Tensor) -> onnx.ModelProto:
    linear = onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")
    onnx.helper.set_metadata_props(linear, {"pkg.torch.onnx.fx_node": "aten.linear.default](args = (%x, %p_probe_weight))"})
    graph = onnx.helper.make_graph(
        [linear],
        "one-layer",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", weight.shape[0]])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", weight.shape[1]])],
        [onnx.numpy_helper.from_array(weight.numpy(), "w")],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)])


def test_awq_scales_beat_round_to_nearest_on_outlier_channels() -> None:
    """Inputs with a few channels 30x larger than the rest (what AWQ is for): the searched scales give a smaller
    output error than plain INT4 rounding (s = 1) on the calibration rows."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 256, generator=generator)
    x[:, :8] *= 30.0
    weight = torch.randn(256, 96, generator=generator) * 0.05
    inputs = LinearInputs()
    inputs.add(x)
    s = awq_scales([weight], inputs, 128)

    def error(scales: torch.Tensor) -> float:
        return float(((x / scales) @ int4_dequantized(weight * scales[:, None], 128) - x @ weight).pow(2).mean())

    assert error(s) < 0.8 * error(torch.ones(256))


def test_one_row_calls_run_as_two_rows_give_the_same_results(tiny_repo: Path) -> None:
    """The runner's padding of one-row calls (on where a quantized kernel's one-row path rounds differently), on
    any CPU: on the float engine, padded calls give the tokens and state rows of unpadded ones."""
    padded, _ = load_engine(tiny_repo, max_batch=1)
    unpadded, _ = load_engine(tiny_repo, max_batch=1)
    padded.runner.pad_single_rows = True
    run, batches = padded.runner._run, []

    def counted(graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batches.append(len(inputs["input_ids" if graph == "prefill" else "block"]))
        return run(graph, inputs)

    padded.runner._run = counted
    for prompt, policy in (([5], FixedVerify(0)), ([3, 14, 15, 9], FixedVerify(padded.block_size - 1))):
        expected = generate(unpadded, prompt, 24, policy=policy)
        assert generate(padded, prompt, 24, policy=policy).tokens == expected.tokens
        for state in ("target_k", "target_v"):
            written = len(prompt) + 23
            torch.testing.assert_close(padded.pool.tensors[state][:, 0, :written], unpadded.pool.tensors[state][:, 0, :written])
    assert batches.count(2) >= 20 and set(batches) == {1, 2}, "one-row calls (the prefill of [5], k = 0 steps) ran as two rows"


@pytest.mark.slow
def test_sampling_on_a_quantized_engine_follows_its_own_target(tmp_path: Path) -> None:
    """Quantization changes the target; DFlash must not change it further: the first tokens sampled through DFlash
    on an int4 engine follow the distribution of that engine's own logits (chi-square)."""
    target_dir, _ = _pair(tmp_path, Qwen3Config(**SHARED, bos_token_id=0), seed=4)
    write_tiny_tokenizer(target_dir, VOCAB)
    options = ("--block-size", "4", "--max-seq-len", "32", "--max-batch-size", str(SLOTS), "--quantize", "int4")
    repo = _build(target_dir, tmp_path / "drafter", tmp_path / "repo", *options)
    engine, _ = load_engine(repo)
    counts, accepted = _dflash_counts(engine, SamplingParams(1.0))
    assert accepted > counts.sum() // 20, "the acceptance path was hardly exercised"
    assert _chi_square_p(counts, _engine_distribution(repo)) > 1e-3


def _engine_distribution(repo: Path) -> np.ndarray:
    """[V]*NEW_TOKENS probabilities of the first tokens at T=1 under the quantized engine's own logits."""
    engine = logits_engine(repo, threads=None)

    def probs(prefix: list[int]) -> np.ndarray:
        return torch.softmax(block_logits(engine, PROMPT + prefix)[-1].double(), -1).numpy()

    table = np.zeros((VOCAB,) * NEW_TOKENS)
    for index in np.ndindex(*table.shape):
        table[index] = np.prod([probs(list(index[:i]))[index[i]] for i in range(NEW_TOKENS)])
    return table


def test_bad_modes_fail_at_build_time(tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path: Path, capsys) -> None:
    base = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--output", str(tmp_path / "r")]
    assert dflash_build([*base, "--quantize", "int3"]) == 2
    assert "--quantize 'int3' is not a mode; choose one of none, int8, int4" in capsys.readouterr().err
    assert dflash_build([*base, "--quantize", "int8", "--backend", "tensorrt"]) == 2
    assert "--quantize int8 builds onnxruntime operators, and this build's backend is tensorrt" in capsys.readouterr().err
    assert dflash_build([*base, "--quantize", "fp8", "--backend", "torch-cuda"]) == 2
    assert "--quantize fp8 builds tensorrt operators, and this build's backend is torch-cuda" in capsys.readouterr().err
    assert dflash_build([*base, "--quantize-drafter", "int3"]) == 2
    assert "--quantize-drafter 'int3' is not a mode; choose one of none, int8, int4" in capsys.readouterr().err
    assert dflash_build([*base, "--quantize-drafter", "int4", "--backend", "torch-cuda"]) == 2
    expected = "--quantize-drafter int4 builds onnxruntime operators, and this build's backend is torch-cuda"
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_plan_accounts_for_the_mode(capsys) -> None:
    """--plan of the Qwen3.5-27B pair: int4 linear layers (bf16 embeddings, 8-bit LM head) cost about 0.3x the bf16
    weights, which leaves room for more sequences; TensorRT's fp8 and int4-awq keep a bf16 LM head but scale per
    channel (fp8) or per 128 weights (int4-awq) where MatMulNBits has a float32 scale per 32 weights: lighter than
    the ONNX Runtime mode of their bits."""
    fixtures = SHIPPED_CONFIGS / "qwen3.5-27b"
    command = ["--model", str(fixtures / "target"), "--drafter", str(fixtures / "drafter"), "--plan", "--backend", "onnxruntime"]
    plans = {}
    for mode in ("none", "int8", "int4", "fp8", "int4-awq"):
        assert dflash_build([*command, "--gpu-memory", "141GB", "--max-seq-len", "32768", "--quantize", mode]) == 0
        rows = dict(line.rsplit("  ", 1) for line in capsys.readouterr().out.splitlines()[1:])
        plans[mode] = {name.strip(): value.strip() for name, value in rows.items()}
    assert plans["int4"]["weights (int4 linear layers, bfloat16 embeddings, target + drafter)"] == "18.9 GiB"
    weights = {
        mode: float(next(v for k, v in rows.items() if k.startswith("weights")).split()[0]) for mode, rows in plans.items()
    }
    assert weights["none"] > 2.5 * weights["int4"] and weights["none"] > 1.7 * weights["int8"] > weights["int4"]
    assert weights["int8"] > weights["fp8"] > weights["int4"] > weights["int4-awq"]
    fits = {mode: int(next(v for k, v in rows.items() if k.startswith("sequences")).split()[0]) for mode, rows in plans.items()}
    assert fits["int4"] > fits["int8"] > fits["none"]


def test_quality_logits_are_the_targets(tiny_repo: Path, tiny_targets: dict[str, Path]) -> None:
    """dflash-quality reads logits from the float32 engine's own decode graph: they equal transformers' logits of
    the same checkpoint (1e-4), and its perplexity is exp of transformers' mean next-token loss."""
    from dflash_trt.runtime.quality import perplexity
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(1, 90, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    model = AutoModelForCausalLM.from_pretrained(tiny_targets["qwen3"], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0]
    engine = logits_engine(tiny_repo, threads=None)
    torch.testing.assert_close(block_logits(engine, tokens), expected, atol=1e-4, rtol=1e-4)
    loss = torch.nn.functional.cross_entropy(expected[:-1], torch.tensor(tokens[1:]))
    assert perplexity(engine, [tokens]) == pytest.approx((float(loss.exp()), 39), rel=1e-4)
