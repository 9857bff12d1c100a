"""dflash-deploy k8s: every overlay renders with `kubectl kustomize` and passes strict validation offline (built-in
kinds with kubernetes-validate for Kubernetes 1.30 and 1.37, custom resources against upstream CRDs kept as data in
shared/ext); planted unknown fields fail; the probes and gauges the manifests name answer on a real tritonserver."""

from __future__ import annotations

import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from dflash_trt.builder.kubernetes import Deployment, crd_schemas, problems, render, validate_tree, write_tree
from dflash_trt.client.triton_client import Request, stream_tokens

from tests.conftest import running_server

CRDS = Path(__file__).resolve().parents[2] / "shared" / "ext" / "crds"
VERSIONS = ("1.30", "1.37")
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) is not installed")
needs_crds = pytest.mark.skipif(not CRDS.is_dir(), reason=f"no upstream CRDs at {CRDS}")


@pytest.fixture(scope="module")
def tree(tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("k8s")
    deployment = Deployment(tiny_repo, "example.com/dflash-trt:test", "dflash", 2, None, None, "gw", "http://prom:9090")
    write_tree(deployment, output)
    return output


@needs_kubectl
@needs_crds
def test_every_overlay_renders_and_validates_strictly(tree: Path) -> None:
    failures = validate_tree(tree, VERSIONS, CRDS)
    assert sorted(p.name for p in failures) == ["base", "gateway", "hpa", "keda", "kserve", "monitoring"]
    assert all(found == [] for found in failures.values()), failures
    kinds = {obj["kind"] for directory in failures for obj in render(directory)}
    assert {
        "GRPCRoute",
        "HTTPRoute",
        "InferencePool",
        "ScaledObject",
        "PodMonitor",
        "ServingRuntime",
        "InferenceService",
    } <= kinds


@needs_kubectl
@needs_crds
def test_unknown_fields_fail_the_same_check(tree: Path) -> None:
    crds = crd_schemas(CRDS)
    for directory, planted in [
        ("base", ("Deployment", "spec", "bogusField")),
        ("overlays/keda", ("ScaledObject", "spec", "bogus")),
    ]:
        objects = render(tree / directory)
        target = next(o for o in objects if o["kind"] == planted[0])
        target[planted[1]][planted[2]] = 1
        found = problems(objects, VERSIONS, crds)
        assert found and all(planted[2] in f for f in found), found
    pool = next(o for o in render(tree / "overlays/gateway") if o["kind"] == "InferencePool")
    pool["spec"]["targetPorts"][0]["name"] = "x"
    assert any("'name' was unexpected" in f for f in problems([pool], VERSIONS, crds))
    assert problems([{"apiVersion": "example.com/v1", "kind": "Unknown", "metadata": {"name": "u"}}], VERSIONS, crds)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


@pytest.mark.slow
def test_probes_and_gauges_the_manifests_name_answer_on_a_real_server(
    tree: Path, tiny_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    deployment = next(o for o in yaml.safe_load_all((tree / "base/deployment.yaml").read_text()))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    queries = (tree / "overlays/hpa/hpa.yaml").read_text() + (tree / "overlays/hpa/adapter-rules.yaml").read_text()
    queries += (tree / "overlays/keda/scaledobject.yaml").read_text()
    names = set(re.findall(r"dflash_[a-z_]+", queries))
    assert names >= {"dflash_waiting_requests", "dflash_slot_usage_ratio"}
    with running_server(tiny_repo, tmp_path_factory.mktemp("triton-k8s")) as ports:
        for probe in ("readinessProbe", "livenessProbe"):
            path = container[probe]["httpGet"]["path"]
            with urllib.request.urlopen(f"http://localhost:{ports.http}{path}", timeout=5) as answer:
                assert answer.status == 200, probe
        assert container["startupProbe"]["grpc"]["port"] == 8001
        with grpc.insecure_channel(f"localhost:{ports.grpc}") as channel:  # grpc.health.v1.Health/Check, empty request
            check = channel.unary_unary("/grpc.health.v1.Health/Check", lambda b: b, lambda b: b)
            assert check(b"", timeout=5) == b"\x08\x01"  # status: SERVING
        assert names <= set(re.findall(r"^(dflash_[a-z_]+)\{", _scrape(ports.metrics), re.MULTILINE))

        # 16 requests on 8 slots: the gauges show 8 running and the rest waiting while they are served.
        threads = [
            threading.Thread(target=lambda k=k: list(stream_tokens(f"localhost:{ports.grpc}", [3, 14, k + 1], Request(200))))
            for k in range(16)
        ]
        for thread in threads:
            thread.start()
        seen = {"running": 0.0, "waiting": 0.0, "usage": 0.0}
        deadline = time.perf_counter() + 30
        while any(t.is_alive() for t in threads) and time.perf_counter() < deadline:
            text = _scrape(ports.metrics)
            seen["running"] = max(seen["running"], _gauge(text, "dflash_running_requests"))
            seen["waiting"] = max(seen["waiting"], _gauge(text, "dflash_waiting_requests"))
            seen["usage"] = max(seen["usage"], _gauge(text, "dflash_slot_usage_ratio"))
        for thread in threads:
            thread.join(timeout=60)
        assert seen == {"running": 8.0, "waiting": pytest.approx(seen["waiting"]), "usage": 1.0} and seen["waiting"] > 0, seen
        idle = _scrape(ports.metrics)
        assert (_gauge(idle, "dflash_running_requests"), _gauge(idle, "dflash_slot_usage_ratio")) == (0.0, 0.0)
