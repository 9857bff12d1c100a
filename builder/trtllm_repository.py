"""`dflash-build --backend trtllm`: a Triton model repository for TensorRT-LLM's PyTorch engine with DFlash, for
models beyond one GPU (tensor, pipeline and expert parallel). Nothing is compiled or downloaded here: TensorRT-LLM
loads the checkpoints itself in its container. Written, from the configs alone:

- `tensorrt_llm/1/model.yaml`: the arguments of Triton's `llmapi` model (LLM(**args) plus `triton_config`). Its
  code (model.py, config.pbtxt) ships in the container under /app/all_models/llmapi/ and is copied in by
  `launch.sh` when the server starts; this project never holds a copy.
- `ensemble/`: our front model, the same contract as an ONNX Runtime repository's (tensorrtllm_backend's names),
  mapped onto llmapi's inputs and outputs: dflash-client works unchanged; dflash-openai and dflash-bench --served
  also need the target's tokenizer (--tokenizer), which such a repository does not hold.
- `launch.sh`: run inside nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (GPUs, the project pip-installed).
- `trtllm-serve.yaml`: the same LLM arguments for `trtllm-serve serve MODEL --config trtllm-serve.yaml`.
- `dynamo-agg.yaml`: a ConfigMap with those arguments and an aggregated Dynamo DynamoGraphDeployment (nvidia.com/
  v1beta1) whose TensorRT-LLM worker reads them (--extra-engine-args). No disaggregated variant: DFlash needs the
  prompt's tapped hidden states on the decode side, which no engine has shown across prefill/decode workers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

import yaml
from dflash_trt.builder.parallel_plan import Parallelism
from dflash_trt.builder.repository import templates_dir, write_manifest, write_templates
from dflash_trt.builder.trtllm_args import TRTLLM_CONTAINER, TRTLLM_RELEASE, LlmapiModelYaml, LlmArgs, validated

DYNAMO_IMAGE = "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.3.1"  # Dynamo's own trtllm example tag
TRTLLM_FILES = ("tensorrt_llm/1/model.yaml", "trtllm-serve.yaml", "launch.sh", "dynamo-agg.yaml", "ensemble/config.pbtxt")


@dataclass(frozen=True)
class ServedPair:
    """What TensorRT-LLM loads: hub ids or paths as the container sees them."""

    model: str
    drafter: str
    name: str  # the served model's name (Dynamo, trtllm-serve)


def llm_args(
    pair: ServedPair, parallel: Parallelism, block_size: int, max_batch_size: int, max_seq_len: int, fraction: float
) -> dict:
    """LLM(**args) for the pair, checked against the pinned release's mirror."""
    values = {
        "model": pair.model,
        "backend": "pytorch",
        "tensor_parallel_size": parallel.tp,
        "pipeline_parallel_size": parallel.pp,
        "moe_expert_parallel_size": parallel.ep if parallel.ep > 1 else None,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max_seq_len,  # a whole prompt in one iteration (no chunked prefill)
        "kv_cache_config": {"free_gpu_memory_fraction": fraction},
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": block_size - 1, "speculative_model": pair.drafter},
    }
    return validated(LlmArgs, values, "the LLM arguments")


class _BlockStrings(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's file) as YAML block literals, readable in the manifest."""


_BlockStrings.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)
)


def kubernetes_name(served: str) -> str:
    """A served model's name as a Kubernetes object name (RFC 1123 label, room left for '-engine-args')."""
    name = re.sub(r"[^a-z0-9-]+", "-", served.lower()).strip("-")[:50].strip("-")
    if not name:
        raise ValueError(f"{served!r} gives no Kubernetes name: serve it under a name with letters or digits")
    return name


def _yaml(data: object) -> str:
    return yaml.dump(data, Dumper=_BlockStrings, sort_keys=False, default_flow_style=False)


def dynamo_deployment(pair: ServedPair, parallel: Parallelism, args_text: str, image: str) -> str:
    """A ConfigMap holding the LLM arguments and the aggregated DynamoGraphDeployment that mounts them."""
    name = kubernetes_name(pair.name)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-engine-args"},
        "data": {"engine-args.yaml": args_text},
    }
    worker_args = [
        "--model", pair.model, "--served-model-name", pair.name,
        "--tensor-parallel-size", str(parallel.tp), "--pipeline-parallel-size", str(parallel.pp),
        "--expert-parallel-size", str(parallel.ep), "--extra-engine-args", "/engine-args/engine-args.yaml",
    ]  # fmt: skip
    worker = {
        "name": "main",
        "image": image,
        "command": ["python3", "-m", "dynamo.trtllm"],
        "args": worker_args,
        "resources": {"limits": {"nvidia.com/gpu": str(parallel.gpus)}},
        "volumeMounts": [{"name": "engine-args", "mountPath": "/engine-args", "readOnly": True}],
    }
    deployment = {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name},
        "spec": {
            "backendFramework": "trtllm",
            "components": [
                {"name": "Frontend", "type": "frontend", "replicas": 1,
                 "podTemplate": {"spec": {"containers": [{"name": "main", "image": image}]}}},
                {"name": "TRTLLMWorker", "type": "worker", "replicas": 1,
                 "podTemplate": {"spec": {"containers": [worker],
                                          "volumes": [{"name": "engine-args", "configMap": {"name": f"{name}-engine-args"}}]}}},
            ],
        },
    }  # fmt: skip
    header = (
        f"# dflash-build --backend trtllm: aggregated DFlash serving on Dynamo (TensorRT-LLM {TRTLLM_RELEASE} arguments).\n"
        f"# The image must bundle TensorRT-LLM >= {TRTLLM_RELEASE}; {image} was not run here (--dynamo-image sets it).\n"
    )
    return header + _yaml(config_map) + "---\n" + _yaml(deployment)


def write_trtllm_repository(
    repo: Path,
    pair: ServedPair,
    parallel: Parallelism,
    args: dict,
    max_batch_size: int,
    dynamo_image: str,
    manifest: dict[str, object],
) -> None:
    """Every file of the repository into `repo` (a staging directory), the manifest last. Only models are
    directories: tritonserver takes every subdirectory of a model repository for a model."""
    write_templates(
        repo, {"max_batch_size": str(max_batch_size), "engine_model": "tensorrt_llm", "tokenizer_dir": "",
               "apply_chat_template": "false"}, models=("ensemble",),
    )  # fmt: skip
    model_yaml = validated(LlmapiModelYaml, {**args, "triton_config": {"max_batch_size": 0, "decoupled": True}}, "model.yaml")
    (repo / "tensorrt_llm" / "1").mkdir(parents=True)
    header = f"# Triton llmapi model arguments (TensorRT-LLM {TRTLLM_RELEASE}); launch.sh adds the model's code.\n"
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(header + _yaml(model_yaml))
    args_text = _yaml(args)
    (repo / "trtllm-serve.yaml").write_text(f"# trtllm-serve serve {pair.model} --config trtllm-serve.yaml\n" + args_text)
    launch = Template((templates_dir() / "trtllm" / "launch.sh").read_text())
    (repo / "launch.sh").write_text(launch.substitute(release=TRTLLM_RELEASE, container=TRTLLM_CONTAINER, gpus=parallel.gpus))
    (repo / "launch.sh").chmod(0o755)
    (repo / "dynamo-agg.yaml").write_text(dynamo_deployment(pair, parallel, args_text, dynamo_image))
    write_manifest(repo, manifest)
