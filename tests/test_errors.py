"""Bad input gets a clear error naming the value and the fix, never a traceback from deep inside."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dflash_trt.builder.checkpoints import CheckpointError
from dflash_trt.builder.graphs import torch_engine
from dflash_trt.builder.networks import load_pair, load_target
from dflash_trt.runtime.engine import GraphEngine
from dflash_trt.runtime.loop import StopCriteria, generate
from dflash_trt.runtime.sampling import RequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_targets: dict[str, Path], tiny_drafter: Path) -> GraphEngine:
    return torch_engine(*load_pair(tiny_targets["llama"], tiny_drafter), max_seq_len=100)


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "sampling", "message"),
    [
        ([], 8, SamplingParams(), "prompt is empty"),
        ([1, 2], 0, SamplingParams(), "max_tokens=0 must be positive"),
        ([1, 2], -3, SamplingParams(), "max_tokens=-3 must be positive"),
        ([1, 2], 8, SamplingParams(temperature=-0.5), "temperature=-0.5 is invalid"),
        ([1, 2], 8, SamplingParams(temperature=1.0, top_p=0.0), r"top_p=0.0 is outside \(0, 1\]"),
        ([1, 2], 8, SamplingParams(temperature=1.0, top_p=1.5), r"top_p=1.5 is outside \(0, 1\]"),
        ([1, 2], 8, SamplingParams(temperature=1.0, top_k=-1), "top_k=-1 is invalid"),
        ([1] * 90, 20, SamplingParams(), r"= 110 exceeds the maximum sequence length 100.*--max-seq-len"),
        ([1, 500], 8, SamplingParams(), r"token ids \[500\] are outside the vocabulary \[0, 96\)"),
    ],
)
def test_bad_requests(
    engine: GraphEngine, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        generate(engine, prompt, max_new_tokens, sampling)


def test_stop_strings_need_a_decoder(engine: GraphEngine) -> None:
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        generate(engine, [1, 2], 4, stop=StopCriteria(stop_strings=("x",)))


def test_generation_stops_on_eos_and_stop_strings(engine: GraphEngine) -> None:
    free = generate(engine, [5, 6, 7], 40).tokens
    eos = free[10]
    stopped = generate(engine, [5, 6, 7], 40, stop=StopCriteria(eos_token_ids=(eos,)))
    assert stopped.tokens == free[: free.index(eos) + 1]
    assert stopped.stats.finish_reason == "stop"
    decode = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    needle = decode(free[12:14])
    by_string = generate(engine, [5, 6, 7], 40, stop=StopCriteria(stop_strings=(needle,), decode=decode))
    assert needle in decode(by_string.tokens) and needle not in decode(by_string.tokens[:-1])
    assert generate(engine, [5, 6, 7], 40).stats.finish_reason == "length"


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key in config.get("dflash_config", {}):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mismatched_drafter(tiny_targets: dict[str, Path], tiny_drafter: Path, tmp_path: Path) -> None:
    target = tiny_targets["llama"]
    with pytest.raises(CheckpointError, match="mask_token_id 4000 is outside the target vocabulary"):
        load_pair(target, _edit_config(tiny_drafter, tmp_path / "mask", mask_token_id=4000))
    with pytest.raises(CheckpointError, match=r"target_layer_ids \[1, 9\] include \[9\], not below the target's 6 layers"):
        load_pair(target, _edit_config(tiny_drafter, tmp_path / "taps", target_layer_ids=[1, 9]))
    with pytest.raises(CheckpointError, match="drafter hidden_size 32 != target hidden_size 64"):
        load_pair(target, _edit_config(tiny_drafter, tmp_path / "hidden", hidden_size=32))
    with pytest.raises(CheckpointError, match="does not name 'DFlashDraftModel'"):
        load_pair(target, _edit_config(tiny_drafter, tmp_path / "arch", architectures=["Qwen3ForCausalLM"]))


def test_bad_checkpoints(tiny_targets: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_target(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported as a target; supported: llama, qwen2, qwen3"):
        load_target(_edit_config(tiny_targets["llama"], tmp_path / "gpt2", model_type="gpt2"))
    no_weights = _edit_config(tiny_targets["llama"], tmp_path / "noweights")
    for path in no_weights.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(CheckpointError, match="holds no \\*.safetensors weights"):
        load_target(no_weights)


def test_engine_limits(tiny_targets: dict[str, Path], tiny_drafter: Path) -> None:
    target, drafter = load_pair(tiny_targets["llama"], tiny_drafter)
    with pytest.raises(ValueError, match=r"max_seq_len=100000 must be in \[1, 512\]"):
        torch_engine(target, drafter, max_seq_len=100000)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # (temperature, top_k, top_p) as a served request sends them; None = not sent
        ((1.0, None, None), SamplingParams()),  # neither top_k nor top_p: greedy, as in TensorRT-LLM
        ((0.7, 0, 0.0), SamplingParams()),
        ((0.0, 20, 0.9), SamplingParams()),  # temperature 0 is greedy
        ((None, 20, None), SamplingParams(1.0, 20, 1.0)),  # top-k alone: no nucleus, temperature 1
        ((0.8, 0, 0.9), SamplingParams(0.8, 0, 0.9)),
        ((0.8, 5, 0.0), SamplingParams(0.8, 5, 1.0)),  # top_p 0 = off
    ],
)
def test_served_sampling_follows_tensorrt_llm_conventions(
    fields: tuple[float | None, int | None, float | None], expected: SamplingParams
) -> None:
    assert SamplingParams.from_request(*fields, seed=None) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((-1.0, 5, None), "temperature=-1.0 is invalid"),
        ((float("inf"), 5, None), "temperature=inf is invalid"),
        ((float("nan"), 5, None), "temperature=nan is invalid"),
        ((1.0, -2, None), "top_k=-2 is invalid"),
        ((1.0, 0, 1.5), "top_p=1.5"),
    ],
)
def test_served_sampling_refuses_bad_values(fields: tuple[float, int, float | None], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingParams.from_request(*fields, seed=None)


def test_engines_the_runtime_cannot_run_are_refused_before_serving(
    tiny_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A repository of TensorRT plans where TensorRT cannot run, of an unknown backend, or of graphs of another
    graph schema: load_engine and dflash-serve refuse it naming the rebuild; the manifest of a default build says
    what it needs."""
    from dflash_trt.runtime.repository import load_engine
    from dflash_trt.runtime.serve import main as dflash_serve

    built = json.loads((tiny_repo / "dflash-manifest.json").read_text())
    assert (built["backend"], built["device"]) == ("onnxruntime", "cpu")  # --backend auto, no TensorRT here
    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    manifests = (repo / "dflash-manifest.json", repo / "dflash/1/engine/manifest.json")
    for path in manifests:
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps({**manifest, "backend": "tensorrt", "device": "cuda"}))
    with pytest.raises(RuntimeError, match="holds TensorRT plans: serving them needs TensorRT 10.*--backend torch-cuda"):
        load_engine(repo)
    assert dflash_serve([str(repo), "--grpc-port", "1", "--http-port", "2", "--metrics-port", "3"]) == 2
    assert "holds TensorRT plans" in capsys.readouterr().err
    for path in manifests:
        path.write_text(json.dumps({**json.loads(path.read_text()), "backend": "openvino"}))
    assert dflash_serve([str(repo), "--grpc-port", "1", "--http-port", "2", "--metrics-port", "3"]) == 2
    assert "holds openvino engines" in capsys.readouterr().err
    for path in manifests:  # graphs built by an older dflash-trt, whose inputs this runtime would not match
        older = {k: v for k, v in json.loads(path.read_text()).items() if k != "graph_schema"}
        path.write_text(json.dumps({**older, "backend": "onnxruntime", "device": "cpu"}))
    with pytest.raises(RuntimeError, match=r"graphs of graph schema unrecorded .*serves schema \d+: rebuild .*--force"):
        load_engine(repo)


def test_the_bundled_tritonserver_is_refused_under_numpy_2() -> None:
    """Seen on a GPU machine: the Python backend of nvidia-pytriton's Triton 2.51 answers with empty outputs under
    NumPy 2, so dflash-serve refuses the pairing with the fix instead of serving empty streams."""
    from dflash_trt.runtime.serve import check_bundled_numpy

    with pytest.raises(RuntimeError, match=r"NumPy 2\.5\.2 is installed.*install 'numpy<2'"):
        check_bundled_numpy("2.5.2")
    check_bundled_numpy("1.26.4")  # what dflash-trt installs


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("train", ["--target", "t", "--output", "o", "--steps", "0"], "--steps 0: give at least 1"),
        ("train", ["--target", "t", "--output", "o", "--anchors", "0"], "--anchors 0: give at least 1"),
        ("train", ["--target", "t", "--output", "o", "--learning-rate", "-1"], "--learning-rate -1.0: give a positive rate"),
        ("serve", ["repo", "--grpc-port", "70000"], "argument --grpc-port: '70000' is not a TCP port"),
        ("serve", ["repo", "--metrics-port", "x"], "argument --metrics-port: 'x' is not a TCP port"),
        ("openai", ["--repo", "r", "--port", "0"], "argument --port: '0' is not a TCP port"),
        ("openai", ["--repo", "r", "--default-max-tokens", "0"], "--default-max-tokens 0: give at least 1"),
        ("deploy", ["k8s", "--repo", "r", "--image", "i", "--output", "o", "--gpus", "-1"], "--gpus -1: give at least 0"),
        ("deploy", ["k8s", "--repo", "r", "--image", "i", "--output", "o", "--replicas", "0"], "--replicas 0: give at least 1"),
        ("quality", ["--repo", "r", "--window", "1"], "--window 1: give at least 2"),
        ("client", ["hello", "--max-tokens", "-3"], "--max-tokens -3: give at least 1"),
        ("build", ["--model", "m", "--output", "o", "--threads", "-2"], "--threads -2: give at least 0"),
        ("generate", ["--target", "t", "--seed", "-5"], "--seed -5: give at least 0"),
    ],
)
def test_command_line_numbers_are_refused_before_any_work(
    command: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each value is refused at parse time, as a usage error naming it (the paths given do not exist: nothing is read)."""
    from dflash_trt.builder import cli as build_cli
    from dflash_trt.builder import kubernetes, train_cli
    from dflash_trt.client import cli, openai_api
    from dflash_trt.runtime import cli as generate_cli
    from dflash_trt.runtime import quality, serve

    mains = {
        "train": train_cli.main,
        "serve": serve.main,
        "openai": openai_api.main,
        "deploy": kubernetes.main,
        "quality": quality.main,
        "client": cli.main,
        "build": build_cli.main,
        "generate": generate_cli.main,
    }
    with pytest.raises(SystemExit) as exit_info:
        mains[command](argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_quality_refuses_paths_without_an_engine_or_text(
    tiny_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_trt.runtime.quality import main as dflash_quality

    for argv, message in [
        (["--repo", str(tmp_path)], f"{tmp_path} has no manifest.json"),
        (["--repo", str(tiny_repo), "--text", str(tmp_path / "held-out.md")], "held-out.md: no such file or directory"),
        (["--repo", str(tiny_repo), "--window", "100000"], "--window 100000 exceeds the engine's maximum sequence length"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            dflash_quality(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
