"""dflash-build --backend trtllm: repositories for TensorRT-LLM's PyTorch engine, built offline from shipped configs.

TensorRT-LLM cannot run here. What can be checked is: the files against golden copies, every emitted key against
the pinned release's published names, the typed mirror's refusals, the rank plan's arithmetic, the Dynamo
deployment against its CRD, and our ensemble streaming through a real tritonserver to dflash-client in front of a
stand-in with exactly the llmapi model's inputs and outputs (labelled as such: tests/standins/llmapi).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from dflash_trt.builder.checkpoints import parse_drafter_config, parse_target_config
from dflash_trt.builder.cli import main as dflash_build
from dflash_trt.builder.kubernetes import Deployment, problems, render, strict_schema, validate_tree, write_tree
from dflash_trt.builder.models import SHIPPED_CONFIGS, pair_configs
from dflash_trt.builder.parallel_plan import Parallelism, check_parallelism, rank_plan, smallest_tp
from dflash_trt.builder.plan import DTYPE_BYTES, drafter_parameters, target_parameters
from dflash_trt.builder.repository import MANIFEST
from dflash_trt.builder.tiny_checkpoints import write_tiny_tokenizer
from dflash_trt.builder.trtllm_args import TRTLLM_RELEASE, LlmapiModelYaml, LlmArgs, validated
from dflash_trt.builder.trtllm_repository import TRTLLM_FILES, kubernetes_name
from dflash_trt.client.triton_client import Request, ServerError, grpc_inputs, http_generate, stream_text
from dflash_trt.runtime.bench import main as dflash_bench
from dflash_trt.runtime.serve import (
    Ports,
    dead_backend_stubs,
    find_triton,
    free_port,
    start_server,
    stop_server,
    wait_ready,
)

from tests.conftest import openai_front_end

GOLDEN = Path(__file__).parent / "golden" / "trtllm"
REFERENCE = Path(__file__).resolve().parents[1] / "builder" / "trtllm_api" / f"tensorrt_llm-{TRTLLM_RELEASE}.json"
STANDIN = Path(__file__).parent / "standins" / "llmapi"
DGD_CRD = Path(__file__).resolve().parents[2] / "shared" / "ext" / "dynamo" / "2a6da14" / "dgd_crd.json"
CRDS = Path(__file__).resolve().parents[2] / "shared" / "ext" / "crds"
UPDATE_GOLDEN_ENV = "DFLASH_TRT_UPDATE_GOLDEN"  # set to 1 to rewrite the golden files from this build
BUILDS = {  # the three: alias -> (extra flags)
    "qwen3.5-27b": [],
    "qwen3.5-122b-a10b": ["--tp", "4", "--ep", "4"],
    "qwen3.5-397b-a17b": ["--tp", "8"],
}
UNSTABLE_MANIFEST_KEYS = ("dflash_trt_version", "built_at")
CHAT_TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"


@pytest.fixture(autouse=True)
def offline_without_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub, and an empty hub cache: the shipped configs are what is read."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("empty-hf-home")))


def _build(alias: str, output: Path, *extra: str) -> int:
    flags = ["--max-seq-len", "32768", "--max-batch-size", "16"]
    return dflash_build(["--model", alias, "--backend", "trtllm", "--output", str(output), *flags, *extra])


@pytest.fixture(scope="module")
def repositories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trtllm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_HOME", str(root / "empty-hf-home"))
        for alias, extra in BUILDS.items():
            assert _build(alias, root / alias, *extra) == 0
    return {alias: root / alias for alias in BUILDS}


def _stable_manifest(repo: Path) -> str:
    manifest = json.loads((repo / MANIFEST).read_text())
    return json.dumps({k: v for k, v in manifest.items() if k not in UNSTABLE_MANIFEST_KEYS}, indent=2) + "\n"


@pytest.mark.parametrize("alias", BUILDS)
def test_repository_equals_its_golden_files(repositories: dict[str, Path], alias: str) -> None:
    repo, golden = repositories[alias], GOLDEN / alias
    written = {name: (repo / name).read_text() for name in TRTLLM_FILES} | {MANIFEST: _stable_manifest(repo)}
    if os.environ.get(UPDATE_GOLDEN_ENV) == "1":
        for name, text in written.items():
            (golden / name).parent.mkdir(parents=True, exist_ok=True)
            (golden / name).write_text(text)
    for name, text in written.items():
        assert text == (golden / name).read_text(), f"{alias}/{name} is not its golden copy ({UPDATE_GOLDEN_ENV}=1 rewrites)"
    assert (repo / "ensemble" / "1" / "model.py").is_file() and os.access(repo / "launch.sh", os.X_OK)
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists(), "the llmapi model's code is never copied into a build"


def test_emitted_keys_are_names_the_release_publishes(repositories: dict[str, Path]) -> None:
    names = {cls: set(entry["names"]) for cls, entry in json.loads(REFERENCE.read_text())["classes"].items()}
    for repo in repositories.values():
        model_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
        assert set(model_yaml) - {"triton_config"} <= names["LLM"]
        assert set(model_yaml["speculative_config"]) <= names["DFlashDecodingConfig"]
        assert set(model_yaml["kv_cache_config"]) <= names["KvCacheConfig"]
        assert set(model_yaml["triton_config"]) <= names["llmapi model.yaml triton_config"]
        serve_config = yaml.safe_load((repo / "trtllm-serve.yaml").read_text())
        assert serve_config == {k: v for k, v in model_yaml.items() if k != "triton_config"}
        validated(LlmapiModelYaml, model_yaml, "model.yaml")  # what was written passes the mirror again


def test_mirror_refuses_unknown_keys_and_bad_values(repositories: dict[str, Path]) -> None:
    args = yaml.safe_load((repositories["qwen3.5-122b-a10b"] / "trtllm-serve.yaml").read_text())
    with pytest.raises(ValueError, match=rf"TensorRT-LLM {TRTLLM_RELEASE}: speculative_decoding_config: Extra inputs"):
        validated(LlmArgs, {**args, "speculative_decoding_config": {}}, "args")
    eagle = {**args, "speculative_config": {**args["speculative_config"], "decoding_type": "Eagle3"}}
    with pytest.raises(ValueError, match="speculative_config.decoding_type: Input should be 'DFlash'"):
        validated(LlmArgs, eagle, "args")
    with pytest.raises(ValueError, match="speculative_config.max_draft_len: Input should be greater than or equal to 1"):
        validated(LlmArgs, {**args, "speculative_config": {**args["speculative_config"], "max_draft_len": 0}}, "args")
    with pytest.raises(ValueError, match="moe_expert_parallel_size 3 must divide tensor_parallel_size 4"):
        validated(LlmArgs, {**args, "moe_expert_parallel_size": 3}, "args")


def _configs(alias: str) -> tuple:
    target_raw, drafter_raw = pair_configs(alias, None, shipped=True)
    return parse_target_config(target_raw), parse_drafter_config(drafter_raw) if drafter_raw else None


def test_rank_plan_shards_weights_and_state() -> None:
    """122B-A10B at TP 4 / EP 4: every layer a quarter (K/V heads: 2 of 2 replicated over 4 ranks -> 1 each), the
    two vocabulary matrices a quarter, the drafter whole; 397B-A17B needs TP 8 on 141 GB GPUs, 27B fits on one."""
    target, drafter = _configs("qwen3.5-122b-a10b")
    assert target.moe is not None and 121e9 < target_parameters(target) < 123e9
    plan = rank_plan(target, drafter, "bfloat16", 32768, 16, Parallelism(tp=4, ep=4))
    vocabulary = 2 * target.vocab_size * target.hidden_size
    kv = len(target.attention_layers) * 2 * target.hidden_size * target.num_kv_heads * target.head_dim
    layers = target_parameters(target) - vocabulary - target.hidden_size
    expected = (layers - kv) / 4 + kv / 2 + vocabulary / 4 + drafter_parameters(drafter)
    assert plan.weight_bytes == int((layers - kv) / 4 + kv / 2 + vocabulary / 4) * 2 + drafter_parameters(drafter) * 2
    assert abs(plan.weight_bytes - expected * DTYPE_BYTES["bfloat16"]) < 16
    assert plan.state.kv_bytes_per_token == 12 * 2 * 1 * 256 * 2  # 12 attention layers, 1 K/V head per rank
    assert plan.state.recurrent_bytes_per_sequence == 36 * (16 * 128 * 128 * 4 + 3 * (2 * 2048 + 8192) * 2 // 4)
    assert smallest_tp(*_configs("qwen3.5-397b-a17b"), "bfloat16", 32768, 16, 141 * 10**9, 16) == 8
    assert smallest_tp(*_configs("qwen3.5-27b"), "bfloat16", 32768, 16, 141 * 10**9, 16) == 1
    one_gpu = rank_plan(*_configs("qwen3.5-27b"), "bfloat16", 32768, 16, Parallelism())
    fit = one_gpu.sequences_that_fit(141 * 10**9)  # what the plan prints is what a build accepts, and no more
    assert 0 < one_gpu.kv_cache_fraction(141 * 10**9, fit) <= 0.9
    with pytest.raises(ValueError, match=rf"do not fit on one rank of TP 1 x PP 1 in --gpu-memory \({fit} would\)"):
        one_gpu.kv_cache_fraction(141 * 10**9, fit + 1)


@pytest.mark.parametrize(
    ("alias", "parallel", "message"),
    [
        ("qwen3.5-122b-a10b", Parallelism(tp=4, ep=3), "--ep 3 must divide --tp 4"),
        ("qwen3.5-27b", Parallelism(tp=2, ep=2), "expert parallelism needs a mixture-of-experts target"),
        ("qwen3.5-27b", Parallelism(tp=5), "--tp 5 must divide the target's 24 attention heads"),
        ("qwen3.5-397b-a17b", Parallelism(tp=1, pp=61), "--pp 61 exceeds the target's 60 layers"),
    ],
)
def test_unshardable_parallelism_is_refused(alias: str, parallel: Parallelism, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_parallelism(_configs(alias)[0], parallel)


def test_bad_requests_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _build("qwen3.5-27b", tmp_path / "a", "--tp", "2", "--ep", "2") == 2
    assert "expert parallelism needs a mixture-of-experts target" in capsys.readouterr().err
    assert _build("qwen3.5-122b-a10b", tmp_path / "b") == 2  # TP 1: 229 GiB of weights on one 141 GB GPU
    assert "do not fit on one rank of TP 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dflash_build(["--model", "qwen3.5-27b", "--tp", "2", "--output", str(tmp_path / "c")])
    assert "add --backend trtllm" in capsys.readouterr().err
    assert _build("qwen3.5-27b", tmp_path / "d", "--quantize", "int8") == 2
    assert "TensorRT-LLM loads quantized weights from the checkpoint" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_dynamo_deployment_validates_against_its_crd(repositories: dict[str, Path]) -> None:
    if not DGD_CRD.is_file():
        pytest.skip(f"no DynamoGraphDeployment CRD at {DGD_CRD}")
    crd = json.loads(DGD_CRD.read_text())
    schemas = {(f"{crd['group']}/{name}", crd["kind"]): strict_schema(version["openAPIV3Schema"])
               for name, version in crd["versions"].items() if version["served"]}  # fmt: skip
    for alias, repo in repositories.items():
        objects = list(yaml.safe_load_all((repo / "dynamo-agg.yaml").read_text()))
        assert [o["kind"] for o in objects] == ["ConfigMap", "DynamoGraphDeployment"]
        assert problems(objects, ("1.30", "1.37"), schemas) == [], alias
        worker = objects[1]["spec"]["components"][1]["podTemplate"]["spec"]["containers"][0]
        engine_args = yaml.safe_load(objects[0]["data"]["engine-args.yaml"])
        assert engine_args == yaml.safe_load((repo / "trtllm-serve.yaml").read_text())
        gpus = json.loads((repo / MANIFEST).read_text())["parallel"]["gpus"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    typo = list(yaml.safe_load_all((repositories["qwen3.5-27b"] / "dynamo-agg.yaml").read_text()))[1]
    typo["spec"]["components"][0]["replica"] = 1  # the CRD's strict schema refuses an unknown field
    assert any("'replica' was unexpected" in p for p in problems([typo], ("1.37",), schemas))


@pytest.mark.skipif(shutil.which("kubectl") is None or not CRDS.is_dir(), reason="needs kubectl and the upstream CRDs")
def test_kubernetes_overlay_runs_launch_script_on_every_gpu(repositories: dict[str, Path], tmp_path: Path) -> None:
    deployment = Deployment(repositories["qwen3.5-122b-a10b"], "example.com/tritonserver-trtllm:test", "qwen", 1, None,
                            None, "gw", "http://prom:9090")  # fmt: skip
    written = write_tree(deployment, tmp_path)
    assert [d.relative_to(tmp_path).as_posix() for d in written] == ["base", "overlays/monitoring", "overlays/trtllm"]
    objects = render(tmp_path / "overlays" / "trtllm")
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["/models/qwen3.5-122b-a10b/launch.sh"] and "args" in container
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4  # --tp 4 x --pp 1
    assert {v["name"] for v in pod["volumes"]} == {"models", "shm", "trtllm-repo"}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/models", "/dev/shm", "/trtllm-repo"}
    assert all(not found for found in validate_tree(tmp_path, ("1.30", "1.37"), CRDS).values())


def test_local_checkpoint_directories_are_served_as_given(tmp_path: Path) -> None:
    """--model/--drafter as directories: the files name them as given (the container must see them there), and the
    Dynamo objects take a valid Kubernetes name from the directory's."""
    target, drafter = SHIPPED_CONFIGS / "qwen3.5-122b-a10b" / "target", SHIPPED_CONFIGS / "qwen3.5-122b-a10b" / "drafter"
    command = ["--model", str(target), "--drafter", str(drafter), "--backend", "trtllm", "--tp", "4", "--ep", "4"]
    assert dflash_build([*command, "--max-seq-len", "4096", "--output", str(tmp_path / "repo")]) == 0
    args = yaml.safe_load((tmp_path / "repo" / "trtllm-serve.yaml").read_text())
    assert args["model"] == str(target) and args["speculative_config"]["speculative_model"] == str(drafter)
    objects = list(yaml.safe_load_all((tmp_path / "repo" / "dynamo-agg.yaml").read_text()))
    assert [o["metadata"]["name"] for o in objects] == ["target-engine-args", "target"]
    assert kubernetes_name("Qwen/Qwen3.5_122B.A10B") == "qwen-qwen3-5-122b-a10b"
    with pytest.raises(ValueError, match="gives no Kubernetes name"):
        kubernetes_name("...")


def test_dflash_serve_refuses_the_repository_naming_what_serves_it(repositories: dict[str, Path]) -> None:
    repo = repositories["qwen3.5-122b-a10b"]
    with pytest.raises(RuntimeError, match=r"TensorRT-LLM repository .* 4 GPU\(s\).* Run .*/launch.sh inside nvcr.io"):
        start_server(repo, Ports(free_port(), free_port(), free_port()))
    command = [sys.executable, "-m", "dflash_trt.client.openai_api", "--repo", str(repo)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "holds no tokenizer: pass --tokenizer with the target's" in done.stderr
    bench_command = [sys.executable, "-m", "dflash_trt.runtime.bench", "--repo", str(repo)]
    bench = subprocess.run(bench_command, capture_output=True, text=True, timeout=120)
    assert bench.returncode == 2 and "pass --served HOST:PORT (its tritonserver's gRPC port) and --tokenizer" in bench.stderr


class StandIn(NamedTuple):
    ports: Ports
    log: Path  # what the stand-in saw of stop requests


@pytest.fixture(scope="module")
def standin_server(repositories: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The 27B repository served by its own launch.sh, in a mock of the container: the stand-in where the container
    keeps the llmapi model, a `tensorrt_llm` package that only passes launch.sh's import check, and this machine's
    tritonserver on PATH (its backend directory and ports appended to launch.sh's arguments)."""
    root, repo = tmp_path_factory.mktemp("standin"), repositories["qwen3.5-27b"]
    shutil.copytree(STANDIN, root / "llmapi")
    (root / "site" / "tensorrt_llm").mkdir(parents=True)
    (root / "site" / "tensorrt_llm" / "__init__.py").write_text('"""STAND-IN: passes the import check of launch.sh."""\n')
    triton = find_triton()
    (root / "bin").mkdir()
    (root / "bin" / "tritonserver").symlink_to(triton.binary)
    path = os.pathsep.join([str(root / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]])
    environment = {**os.environ, **triton.env, "PATH": path, "LLMAPI_MODEL_DIR": str(root / "llmapi"),
                   "PYTHONPATH": str(root / "site"), "DFLASH_TRT_WORKDIR": str(root / "work"),
                   "STANDIN_LLMAPI_LOG": str(root / "standin.log")}  # fmt: skip
    ports = Ports(free_port(), free_port(), free_port())
    flags = [f"--backend-directory={triton.backend_dir}", f"--http-port={ports.http}", f"--grpc-port={ports.grpc}",
             f"--metrics-port={ports.metrics}", "--allow-gpu-metrics=false", "--log-verbose=0"]  # fmt: skip
    log = root / "server.log"
    with open(log, "wb") as output:
        process = subprocess.Popen([str(repo / "launch.sh"), *flags], env=environment, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        wait_ready(process, ports.http)
        assert (root / "work" / "tensorrt_llm" / "1" / "model.py").read_bytes() == (STANDIN / "1" / "model.py").read_bytes()
        model_yaml = Path("tensorrt_llm") / "1" / "model.yaml"
        assert (root / "work" / model_yaml).read_text() == (repo / model_yaml).read_text()
        assert not (repo / "tensorrt_llm" / "config.pbtxt").exists(), "launch.sh leaves the repository as built"
        yield StandIn(ports, root / "standin.log")
    finally:
        dead = dead_backend_stubs(process.pid)
        code = stop_server(process)
        assert not dead and code == 0, log.read_text(errors="replace")[-3000:]


def test_launch_script_refuses_outside_the_container(repositories: dict[str, Path], tmp_path: Path) -> None:
    environment = {**os.environ, "LLMAPI_MODEL_DIR": str(tmp_path / "nothing")}
    done = subprocess.run([str(repositories["qwen3.5-27b"] / "launch.sh")], capture_output=True, text=True, env=environment)
    assert done.returncode == 2 and "no llmapi model at" in done.stderr and "trtllm-python-py3" in done.stderr


@pytest.mark.slow
def test_ensemble_maps_the_contract_onto_llmapi(standin_server: StandIn) -> None:
    url = f"localhost:{standin_server.ports.grpc}"
    prompt = "alpha beta gamma delta"
    greedy = list(stream_text(url, prompt, Request(max_tokens=4)))  # temperature 0: greedy, sent as top_k 1
    assert [p["text"] for p in greedy] == [" [top_k=1 max_tokens=4]", " delta", " gamma", " beta"]
    assert [(p["total_draft_tokens"], p["total_accepted_draft_tokens"]) for p in greedy] == [(15, 2), (30, 4), (45, 6), (60, 8)]
    assert greedy[-1]["total_steps"] == -1 and greedy[-1]["total_output_tokens"] == -1  # llmapi reports neither
    assert abs(greedy[-1]["acceptance_rate"] - 2 / 15) < 1e-6
    sampled = Request(max_tokens=3, temperature=0.5, top_k=5, top_p=0.25, seed=7, stop_words=("x", "y"))
    header = "".join(p["text"] for p in stream_text(url, prompt, sampled)).split("]")[0]
    assert header == " [temperature=0.5 top_k=5 top_p=0.25 seed=7 max_tokens=3 stop=x|y"
    base = f"http://localhost:{standin_server.ports.http}"
    assert http_generate(base, prompt, Request(max_tokens=2, stream=False))["text_output"] == " [top_k=1 max_tokens=2] delta"
    body = json.dumps({"text_input": prompt, "max_tokens": 2, "stream": False}).encode()  # exclude_input_in_output unset
    post = urllib.request.Request(f"{base}/v2/models/ensemble/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=60) as answer:  # the prompt echoed in front, as tensorrtllm_backend does
        assert json.loads(answer.read())["text_output"] == prompt + " [top_k=1 max_tokens=2] delta"
    with pytest.raises(ServerError, match="end_id is not an input of TensorRT-LLM's llmapi model"):
        list(stream_text(url, prompt, Request(end_id=2)))


@pytest.mark.slow
def test_dflash_client_streams_from_it(standin_server: StandIn) -> None:
    command = [sys.executable, "-m", "dflash_trt.client.cli", "one two three", "--url", f"localhost:{standin_server.ports.grpc}"]
    done = subprocess.run([*command, "--max-tokens", "3", "--stats"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == " [top_k=1 max_tokens=3] three two\n"
    assert "tau n/a | acceptance rate 13.3% (6/45 draft tokens)" in done.stderr


@pytest.fixture(scope="module")
def openai_client(repositories: dict[str, Path], standin_server: StandIn, tmp_path_factory: pytest.TempPathFactory):
    """dflash-openai in its own process on the 27B trtllm repository, with a tiny chat tokenizer as --tokenizer."""
    tokenizer = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    with openai_front_end(repositories["qwen3.5-27b"], standin_server.ports.grpc, "--tokenizer", str(tokenizer)) as front:
        yield front


@pytest.mark.slow
def test_dflash_bench_measures_it_as_a_client(repositories: dict[str, Path], standin_server: StandIn, tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path / "tokenizer")
    results = tmp_path / "bench.json"
    command = ["--repo", str(repositories["qwen3.5-122b-a10b"]), "--served", f"localhost:{standin_server.ports.grpc}",
               "--tokenizer", str(tmp_path / "tokenizer"), "--num-prompts", "3", "--max-tokens", "8",
               "--json", str(results)]  # fmt: skip
    assert dflash_bench(command) == 0
    measured = json.loads(results.read_text())
    assert measured["backend"] == "trtllm" and measured["parallel"]["gpus"] == 4 and measured["prompts"] == 3
    assert abs(measured["served_acceptance_rate"] - 2 / 15) < 1e-9  # what the engine reported, summed over prompts
    assert measured["served_tok_s_median"] > 0 and measured["served_ttft_ms_median"] > 0


@pytest.mark.slow
def test_openai_front_end_goes_through_the_ensemble_as_text(openai_client) -> None:
    """Completions send the prompt as it is, chat renders the template here; the stand-in answers from what it got."""
    [model] = openai_client.models.list().data
    assert model.id == "Qwen3.5-27B"
    whole = openai_client.completions.create(model=model.id, prompt="w5 w35 w89", max_tokens=3, temperature=0)
    assert whole.choices[0].text == " [top_k=1 max_tokens=3] w89 w35"
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 4)
    assert whole.choices[0].finish_reason == "length"  # 4 tokens counted here for max_tokens 3
    chat = openai_client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=9, temperature=0, stream=True
    )
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " [top_k=1 max_tokens=9] w3 w2 w6 w5 w1"  # the template's "w1 w5 w6 w2 w3", reversed
    assert chunks[-1].choices[0].finish_reason == "stop"  # 7 tokens < 9


@pytest.mark.slow
def test_a_cancelled_stream_stops_the_llmapi_request(standin_server: StandIn) -> None:
    """Triton does not pass a client's cancellation on to a model the ensemble calls: the ensemble sends llmapi a stop
    request with the request's id (llmapi's way), and the stand-in's stream for it ends early."""
    client = grpcclient.InferenceServerClient(f"localhost:{standin_server.ports.grpc}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    words = " ".join(f"w{i}" for i in range(200))  # 200 pieces, 0.02 s apart: 4 s if nothing stops it
    fields = {**Request(200).fields(), "exclude_input_in_output": True}
    client.async_stream_infer("ensemble", grpc_inputs("text_input", np.array([words.encode()], dtype=object), fields))
    answers.get(timeout=30)
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.perf_counter() + 3
    while not (standin_server.log.is_file() and "cut" in standin_server.log.read_text()):
        assert time.perf_counter() < deadline, "the stand-in's stream was never stopped"
        time.sleep(0.05)
    lines = standin_server.log.read_text().split()
    stopped, cut, pieces = lines[1], lines[lines.index("cut") + 1], int(lines[lines.index("cut") + 2])
    assert stopped == cut and stopped.startswith("ensemble-") and pieces < 100
