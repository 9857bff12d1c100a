"""dflash-build end to end on a tiny pair: the repository, the ONNX graphs, and the ONNX Runtime engine."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from dflash_trt.builder.cli import EXPORT_CACHE_ENV
from dflash_trt.builder.cli import main as dflash_build
from dflash_trt.builder.export import WEIGHTS_FILE
from dflash_trt.builder.export_cache import key_record
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.networks import load_pair
from dflash_trt.builder.repository import MANIFEST, is_complete_repository
from dflash_trt.plugins.onnx_domain import DOMAIN
from dflash_trt.runtime.engine import EngineSpec, PrefillRow, StepBatch
from dflash_trt.runtime.graph_io import GRAPH_NAMES, graph_inputs, graph_outputs
from dflash_trt.runtime.loop import generate, generate_plain
from dflash_trt.runtime.onnxruntime_runner import SessionSettings
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import SamplingParams, SamplingTensors
from dflash_trt.runtime.serve import child_processes
from transformers import AutoModelForCausalLM

from tests.conftest import all_nodes

# Standard ONNX operators the TensorRT 10 ONNX parser supports that these graphs may use (onnx-tensorrt's
# operator matrix; `Attention`, opset 23, since the TensorRT 10.14 parser), plus the dflash nodes that become
# plugins. Anything else would break the TensorRT build.
TENSORRT_OPS = {
    "Add", "And", "ArgMax", "Attention", "Cast", "CastLike", "Clip", "Concat", "Constant", "ConstantOfShape", "Conv", "Cos",
    "CumSum", "DequantizeLinear", "Div", "Equal", "Expand", "Gather", "GatherElements", "GatherND", "Greater",
    "GreaterOrEqual", "Identity", "If", "IsNaN", "Less", "LessOrEqual", "MatMul", "Max", "Min", "Mul", "Neg", "Not",
    "Or", "Pow", "QuantizeLinear", "Range", "Reciprocal", "ReduceMax", "ReduceMean", "ReduceSum", "Reshape",
    "ScatterElements", "ScatterND", "Shape", "Sigmoid", "Sin", "Slice", "Softmax", "Softplus", "Split", "Sqrt",
    "Squeeze", "Sub", "Tanh", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where",
}  # fmt: skip
DFLASH_OPS = {"HiddenStateTap", "BlockDenoise"}
NUM_PROMPTS, NEW_TOKENS = 20, 64


def _build_command(target: Path, drafter: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "dflash_trt.builder.cli", "--model", str(target), "--drafter", str(drafter),
            "--output", str(output), "--max-seq-len", "256", "--backend", "onnxruntime"]  # fmt: skip


def _uncached_environment() -> dict[str, str]:
    """The build's environment without the run's export cache (conftest.py): these builds trace for real."""
    return {name: value for name, value in os.environ.items() if name != EXPORT_CACHE_ENV}


def _still_running(pids: list[int], patience: float) -> list[int]:
    """Those of `pids` still running after waiting up to `patience` seconds for them to exit. A zombie counts as
    exited: an orphan is reparented to pid 1, which on some machines (this CI's VM init) never reaps it."""

    def running(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZX"  # stat field 3: the state letter

    deadline = time.monotonic() + patience
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.fixture(scope="module")
def interrupted_then_built(tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path_factory: pytest.TempPathFactory):
    """Kill a build in the middle of its ONNX export, look at what it left, then build again to completion (both
    without the export cache)."""
    output = tmp_path_factory.mktemp("build") / "repo"
    command = _build_command(tiny_targets["qwen3"], trained_drafter, output)
    environment = _uncached_environment()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**environment, "PYTHONUNBUFFERED": "1"})
    assert process.stderr is not None
    for line in process.stderr:
        if "exporting the step graph" in line:
            break
    time.sleep(1.0)
    workers = [pid for pid, _, _ in child_processes(process.pid)]
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert workers, "the graphs are traced in worker processes"
    assert _still_running(workers, patience=20.0) == [], "the build's tracing workers die with it"
    left_behind = sorted(p.name for p in output.parent.iterdir())
    staging_manifests = list(output.parent.glob(".repo.partial-*/" + MANIFEST))
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "export cache" not in completed.stderr
    return output, left_behind, staging_manifests


def test_interrupted_build_leaves_no_valid_output_and_a_rerun_succeeds(interrupted_then_built) -> None:
    output, left_behind, staging_manifests = interrupted_then_built
    assert "repo" not in left_behind, "a killed build must not leave the output directory"
    assert all(name.startswith(".repo.partial-") for name in left_behind)
    assert staging_manifests == [], "the staging directory of a killed build must not hold a manifest"
    assert is_complete_repository(output)
    assert not list(output.parent.glob(".repo.partial-*")), "the rerun cleans up what the killed build left"


def test_repository_layout(interrupted_then_built) -> None:
    output = interrupted_then_built[0]
    assert sorted(p.name for p in output.iterdir() if p.is_dir()) == ["dflash", "ensemble"]
    configs = [output / "ensemble/config.pbtxt", output / "ensemble/configs/unary.pbtxt", output / "dflash/config.pbtxt"]
    for config in configs:
        assert "${" not in config.read_text(), "every template placeholder is filled"
        assert "max_batch_size: 8\n" in config.read_text(), "the batch dimension is the engine's slot count"
    assert "decoupled: true" in configs[0].read_text() and "decoupled: false" in configs[1].read_text()
    assert (output / "dflash/1/tokenizer/tokenizer.json").is_file()
    engine, manifest = load_engine(output)
    assert manifest["backend"] == "onnxruntime" and manifest["engine"]["block_size"] == 16
    assert set(manifest["target"]["sha256"]) >= {"config.json", "model.safetensors"}


def _engine_bytes(repo: Path) -> dict[str, bytes]:
    engine_dir = repo / "dflash" / "1" / "engine"
    return {name: (engine_dir / name).read_bytes() for name in (*[f"{g}.onnx" for g in GRAPH_NAMES], WEIGHTS_FILE)}


def test_export_cache_gives_the_bytes_an_export_writes(
    interrupted_then_built, tiny_repo: Path, tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path: Path, capsys
) -> None:
    """tiny_repo was built through the run's export cache (a miss: traced into the cache, then copied out); a build
    of the same pair with another batch size and thread count is a hit and traces nothing. Both hold the bytes of the
    uncached build of the same options."""
    exported = _engine_bytes(interrupted_then_built[0])
    assert _engine_bytes(tiny_repo) == exported
    command = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--output", str(tmp_path / "r"),
               "--max-seq-len", "256", "--max-batch-size", "2", "--threads", "1"]  # fmt: skip
    assert dflash_build(command) == 0
    log = capsys.readouterr().err
    assert "export cache hit" in log and "exporting the" not in log
    assert _engine_bytes(tmp_path / "r") == exported
    assert load_engine(tmp_path / "r")[1]["engine"]["max_batch_size"] == 2


def test_export_cache_key_holds_what_decides_the_graphs(tiny_repo: Path) -> None:
    spec = EngineSpec.from_json(load_engine(tiny_repo)[1]["engine"])
    hashes = {"config.json": "a", "model.safetensors": "b"}
    key = key_record(spec, hashes, hashes)
    assert key_record(replace(spec, max_batch_size=64), hashes, hashes) == key, "the slot axis is dynamic in the graphs"
    assert key_record(replace(spec, max_seq_len=128), hashes, hashes) != key
    assert key_record(replace(spec, dtype="float16"), hashes, hashes) != key
    assert key_record(spec, hashes, {**hashes, "model.safetensors": "c"}) != key, "a retrained drafter"
    assert set(key["libraries"]) == {"torch", "onnxscript", "onnx-ir", "onnx"} and len(key["sources_sha256"]) == 64


def test_graphs_pass_the_checker_and_use_only_tensorrt_ops(interrupted_then_built) -> None:
    engine_dir = interrupted_then_built[0] / "dflash" / "1" / "engine"
    spec = EngineSpec.from_json(load_engine(interrupted_then_built[0])[1]["engine"])
    expected_custom = {"prefill": DFLASH_OPS, "step": DFLASH_OPS, "verify": {"HiddenStateTap"}, "decode": set()}
    for name in GRAPH_NAMES:
        onnx.checker.check_model(str(engine_dir / f"{name}.onnx"), full_check=True)
        model = onnx.load(str(engine_dir / f"{name}.onnx"), load_external_data=False)
        nodes = all_nodes(model.graph)  # TensorRT parses If branches too
        standard = {n.op_type for n in nodes if n.domain in ("", "ai.onnx")}
        custom = {n.op_type for n in nodes if n.domain == DOMAIN}
        assert standard <= TENSORRT_OPS, f"{name}: operators TensorRT's parser lacks: {standard - TENSORRT_OPS}"
        assert custom == expected_custom[name], f"{name}: dflash nodes {custom}"
        assert {n.domain for n in nodes} <= {"", DOMAIN}
        assert [i.name for i in model.graph.input] == [t.name for t in graph_inputs(name, spec.states)]
        assert [o.name for o in model.graph.output] == [t.name for t in graph_outputs(name, spec.states)]
    # Every large weight is stored once, in the shared file; no Transpose of a weight is left to run at every call.
    sizes = {p.name: p.stat().st_size for p in engine_dir.iterdir()}
    assert sizes["weights.bin"] > max(sizes[f"{n}.onnx"] for n in GRAPH_NAMES)
    blob, stored = (engine_dir / "weights.bin").read_bytes(), set()
    for name in GRAPH_NAMES:
        graph = onnx.load(str(engine_dir / f"{name}.onnx"), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        assert not [n.name for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights], name
        for tensor in graph.initializer:
            where = {e.key: e.value for e in tensor.external_data}
            if where:
                stored.add((int(where["offset"]), int(where["length"])))
    digests = [hashlib.sha256(blob[offset : offset + length]).hexdigest() for offset, length in stored]
    assert len(set(digests)) == len(digests) > 10, "a tensor is stored twice in weights.bin"


def test_onnxruntime_fuses_the_decode_graphs_norms(interrupted_then_built, tmp_path: Path) -> None:
    """The RMSNorms are exported in the form ONNX Runtime's optimizer fuses (layers.rms_normalize): the decode graph
    as the engine's session optimizes it keeps no norm as elementwise kernels, and the rotary embedding negates
    nothing per layer (its sign rides on the sine, layers.rotary_cos_sin)."""
    engine_dir = interrupted_then_built[0] / "dflash" / "1" / "engine"
    options = SessionSettings(intra_op_threads=1).options()
    options.optimized_model_filepath = str(tmp_path / "decode.optimized.onnx")
    ort.InferenceSession(str(engine_dir / "decode.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(str(tmp_path / "decode.optimized.onnx"), load_external_data=False).graph.node]
    exported = [n.op_type for n in onnx.load(str(engine_dir / "decode.onnx"), load_external_data=False).graph.node]
    assert exported.count("Sqrt") > 0 and optimized.count("SimplifiedLayerNormalization") == exported.count("Sqrt")
    assert not {"Sqrt", "Reciprocal", "ReduceMean", "Pow", "Neg"} & set(optimized)


def test_onnxruntime_engine_equals_transformers_greedy(interrupted_then_built, tiny_targets: dict[str, Path]) -> None:
    engine, _ = load_engine(interrupted_then_built[0])
    model = AutoModelForCausalLM.from_pretrained(tiny_targets["qwen3"], dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    longest = 0
    for _ in range(NUM_PROMPTS):
        prompt = torch.randint(1, 90, (int(torch.randint(3, 40, (1,), generator=generator)),), generator=generator).tolist()
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        result = generate(engine, prompt, NEW_TOKENS)
        assert result.tokens == expected[0, len(prompt) :].tolist()
        assert generate_plain(engine, prompt, NEW_TOKENS).tokens == result.tokens
        longest = max(longest, *result.stats.acceptance_lengths)
    assert longest >= 9, "the trained drafter should get long runs accepted through the ORT engine too"


def test_onnxruntime_step_rows_match_torch(interrupted_then_built, tiny_targets: dict[str, Path], trained_drafter: Path) -> None:
    """Pool rows (target K/V and draft-context K/V) within 1e-4 of the torch engine after a prefill and 3 batched steps of
    every graph kind, two sequences in slots that are not 0 and 1."""
    ort_engine, _ = load_engine(interrupted_then_built[0], max_batch=4)
    reference = torch_engine(*load_pair(tiny_targets["qwen3"], trained_drafter), max_seq_len=256, max_batch=4)
    prompts = [[3, 14, 15, 9, 26, 5, 35], [7, 8]]
    slots = torch.tensor([2, 3])
    firsts = [
        [e.prefill([PrefillRow(int(slot), p, 0.5, SamplingParams())]) for slot, p in zip(slots, prompts, strict=True)]
        for e in (reference, ort_engine)
    ]
    block, start = torch.cat([f.next_block for f in firsts[0]]), torch.cat([f.next_start for f in firsts[0]])
    for graph, width in (("step", 16), ("verify", 4), ("step", 1), ("decode", 1)):
        sampling = SamplingTensors.of([SamplingParams()] * 2, 96)
        batch = StepBatch(slots, block[:, :width], start, torch.full((2, width), 0.5), sampling, drafts=15)
        outs = [e.run(graph, batch) for e in (reference, ort_engine)]
        assert torch.equal(outs[0].target_tokens, outs[1].target_tokens) and torch.equal(outs[0].next_block, outs[1].next_block)
        block, start = outs[0].next_block, outs[0].next_start
    for name, tensor in reference.pool.tensors.items():
        assert (tensor - ort_engine.pool.tensors[name]).abs().max() <= 1e-4, name


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=4)],
    ids=["T0.8", "T1-k3-p0.9"],
)
def test_onnxruntime_engine_samples_as_torch(
    interrupted_then_built, tiny_targets: dict[str, Path], trained_drafter: Path, sampling: SamplingParams
) -> None:
    """At T > 0 the exported graphs take their sampling branch and draw what the torch engine draws from the same seed."""
    ort_engine, _ = load_engine(interrupted_then_built[0])
    reference = torch_engine(*load_pair(tiny_targets["qwen3"], trained_drafter), max_seq_len=256)
    prompt = [3, 14, 15, 9, 26, 5, 35]
    sampled = generate(ort_engine, prompt, NEW_TOKENS, sampling).tokens
    assert sampled == generate(reference, prompt, NEW_TOKENS, sampling).tokens
    assert sampled != generate(ort_engine, prompt, NEW_TOKENS).tokens, "a sampled run should leave the greedy path"


def test_tensorrt_backend_fails_clearly_here(
    tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path: Path, capsys
) -> None:
    code = dflash_build(
        [
            "--model",
            str(tiny_targets["qwen3"]),
            "--drafter",
            str(trained_drafter),
            "--backend",
            "tensorrt",
            "--output",
            str(tmp_path / "r"),
        ]
    )
    assert code == 2
    assert "--backend tensorrt needs TensorRT 10+ and an NVIDIA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_build_errors_name_the_value(tiny_targets: dict[str, Path], trained_drafter: Path, tmp_path: Path, capsys) -> None:
    base = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--output", str(tmp_path / "r")]
    assert dflash_build([*base, "--max-seq-len", "100000"]) == 2
    assert "--max-seq-len 100000 must be in (16, 496]" in capsys.readouterr().err
    plan = ["--model", str(tiny_targets["qwen3"]), "--drafter", str(trained_drafter), "--plan"]
    assert dflash_build([*plan, "--max-seq-len", "100000"]) == 2  # no plan for a build that would be refused
    assert "--max-seq-len 100000 must be in (16, 496]" in capsys.readouterr().err
    assert dflash_build(["--model", "no-such-model", "--output", str(tmp_path / "r")]) == 2
    assert "'no-such-model' is neither a directory, a known model" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
