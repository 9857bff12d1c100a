"""dflash-deploy: Kubernetes manifests for a dflash-build repository (a Kustomize base and overlays; no Helm), and
their offline validation.

`dflash-deploy k8s --repo REPO --image IMAGE --output DIR` writes

    DIR/base/                 Deployment (probes, preStop, grace period), Service, headless Service, PodDisruptionBudget
    DIR/overlays/hpa/         + HorizontalPodAutoscaler on the dflash gauges and its prometheus-adapter rules
    DIR/overlays/keda/        + KEDA ScaledObject (prometheus trigger) on the same gauges
    DIR/overlays/monitoring/  + PodMonitor (prometheus-operator) for Triton's metrics port
    DIR/overlays/gateway/     + the dflash-openai container, GRPCRoute, HTTPRoute and an InferencePool
    DIR/overlays/kserve/      ServingRuntime + InferenceService (KServe runs the pods; no base)

and for a `dflash-build --backend trtllm` repository instead (TensorRT-LLM serves it; its llmapi model exports none
of the `dflash_*` gauges that the autoscalers and the InferencePool read, so the autoscaling, gateway and KServe
overlays are not written; `dflash-openai --tokenizer` can still front it by hand):

    DIR/overlays/trtllm/      the pod as the TensorRT-LLM container runs it: the repository's launch.sh, every GPU
                              of its --tp x --pp, shared memory for NCCL, a writable copy of the repository
    DIR/overlays/monitoring/  as above

with values from the repository's manifest (its name, backend, engine size). `dflash-deploy validate DIR` renders
every overlay with `kubectl kustomize` and checks each object strictly (unknown fields fail): built-in kinds with
`kubernetes-validate` for each Kubernetes version asked, custom resources against their CRDs' openAPIV3Schema.

Why these choices: Triton's queue metrics stop at a decoupled model's `execute()`, so autoscaling reads the
`dflash_*` gauges; on SIGTERM tritonserver refuses new requests at once while in-flight streams finish, so a preStop
sleep lets endpoints drop the pod first, and the grace period outlasts preStop plus tritonserver's exit timeout.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from dflash_trt.runtime.options import require_at_least

HTTP_PORT, GRPC_PORT, METRICS_PORT, OPENAI_PORT = 8000, 8001, 8002, 9000
PRESTOP_SECONDS = 15  # endpoints and balancers stop routing to a terminating pod before tritonserver sees SIGTERM
EXIT_TIMEOUT_SECONDS = 120  # tritonserver --exit-timeout-secs: the longest drain of in-flight streams
GAUGES = ("dflash_waiting_requests", "dflash_running_requests", "dflash_slot_usage_ratio")
TRTLLM_HOST_GIB_PER_GPU = 32  # --backend trtllm pods: host memory asked per GPU (not measured: TensorRT-LLM never ran here)
TRTLLM_WORKDIR = "/trtllm-repo"  # where launch.sh copies the repository and adds the llmapi model's code
Object = dict[str, Any]


class Deployment:
    """What the manifests are made from."""

    def __init__(self, repo: Path, image: str, name: str, replicas: int, gpus: int | None, models_image: str | None,
                 gateway: str, prometheus_url: str) -> None:  # fmt: skip
        from dflash_trt.builder.repository import read_repository_manifest
        from dflash_trt.runtime.repository import engine_bytes

        manifest = read_repository_manifest(repo)
        self.repo_name, self.image, self.name, self.replicas = repo.resolve().name, image, name, replicas
        self.backend = manifest["backend"]
        default_gpus = {"tensorrt": 1, "trtllm": manifest.get("parallel", {}).get("gpus", 1)}.get(self.backend, 0)
        self.gpus = default_gpus if gpus is None else gpus
        if self.backend == "trtllm":  # host memory per GPU for TensorRT-LLM's rank processes: an assumption, unmeasured
            self.memory = f"{TRTLLM_HOST_GIB_PER_GPU * max(self.gpus, 1)}Gi"
        else:  # ONNX Runtime measured 2.8 GiB resident for 0.72 GB of engines (four sessions, state pool): 4x + 1 GiB.
            self.memory = f"{math.ceil(4 * engine_bytes(repo) / 2**30 + 1)}Gi"
        self.models_image, self.gateway, self.prometheus_url = models_image, gateway, prometheus_url
        self.labels = {"app.kubernetes.io/name": "dflash-trt", "app.kubernetes.io/instance": name}

    def metadata(self, suffix: str = "") -> Object:
        return {"name": self.name + suffix, "labels": dict(self.labels)}

    # --- base -------------------------------------------------------------------------------------------------

    def triton_container(self) -> Object:
        limits: Object = {"memory": self.memory}
        if self.gpus:
            limits["nvidia.com/gpu"] = self.gpus
        return {
            "name": "triton",
            "image": self.image,
            "command": ["tritonserver"],
            "args": [
                f"--model-repository=/models/{self.repo_name}",
                f"--exit-timeout-secs={EXIT_TIMEOUT_SECONDS}",
                "--allow-metrics=true",
                f"--allow-gpu-metrics={'true' if self.gpus else 'false'}",
            ],
            "ports": [
                {"name": "http", "containerPort": HTTP_PORT},
                {"name": "grpc", "containerPort": GRPC_PORT},
                {"name": "metrics", "containerPort": METRICS_PORT},
            ],
            "resources": {"requests": {"cpu": "2", "memory": self.memory}, "limits": limits},
            # Engine load can take minutes: up to 10 min before liveness starts counting.
            "startupProbe": {"grpc": {"port": GRPC_PORT}, "periodSeconds": 10, "failureThreshold": 60},
            "readinessProbe": {
                "httpGet": {"path": "/v2/health/ready", "port": "http"},
                "periodSeconds": 5,
                "failureThreshold": 2,
            },
            "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        }

    def pod_spec(self) -> Object:
        spec: Object = {
            "terminationGracePeriodSeconds": PRESTOP_SECONDS + EXIT_TIMEOUT_SECONDS + 15,
            "containers": [self.triton_container()],
        }
        if self.models_image:  # the repository baked into an image at /models, copied into the pod at start
            spec["initContainers"] = [
                {
                    "name": "models",
                    "image": self.models_image,
                    "command": ["sh", "-c", "cp -a /models/. /pod-models/"],
                    "volumeMounts": [{"name": "models", "mountPath": "/pod-models"}],
                }
            ]
            spec["volumes"] = [{"name": "models", "emptyDir": {}}]
        else:
            claim = {"claimName": f"{self.name}-models", "readOnly": True}
            spec["volumes"] = [{"name": "models", "persistentVolumeClaim": claim}]
        return spec

    def deployment(self) -> Object:
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.metadata(),
            "spec": {
                "replicas": self.replicas,
                "selector": {"matchLabels": dict(self.labels)},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "template": {"metadata": {"labels": dict(self.labels)}, "spec": self.pod_spec()},
            },
        }

    def services(self) -> list[Object]:
        ports = [
            {"name": "http", "port": HTTP_PORT, "targetPort": "http"},
            {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"},
            {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
        ]
        cluster = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata(),
            "spec": {"selector": dict(self.labels), "ports": ports},
        }
        headless_ports = [ports[1]]  # for client-side round robin over the pods (dns:///NAME-pods:8001)
        headless = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.metadata("-pods"),
            "spec": {"clusterIP": "None", "selector": dict(self.labels), "ports": headless_ports},
        }
        return [cluster, headless]

    def disruption_budget(self) -> Object:
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": self.metadata(),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(self.labels)}},
        }

    # --- overlays ---------------------------------------------------------------------------------------------

    def autoscaler(self) -> Object:
        def pods_metric(name: str, average: str) -> Object:
            return {
                "type": "Pods",
                "pods": {"metric": {"name": name}, "target": {"type": "AverageValue", "averageValue": average}},
            }

        return {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": self.metadata(),
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": self.name},
                "minReplicas": self.replicas,
                "maxReplicas": 4 * self.replicas,
                # Scale out when requests wait for a slot, or when slots run nearly full.
                "metrics": [pods_metric("dflash_waiting_requests", "1"), pods_metric("dflash_slot_usage_ratio", "900m")],
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
            },
        }

    def adapter_rules(self) -> Object:
        """prometheus-adapter's custom-metrics rules that expose the gauges to the HPA (merge into its config)."""
        rules = [
            {
                "seriesQuery": f'{gauge}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{gauge}$", "as": gauge},
                "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
            for gauge in GAUGES
        ]
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.metadata("-adapter-rules"),
            "data": {"config.yaml": yaml.safe_dump({"rules": rules}, sort_keys=False)},
        }

    def scaled_object(self) -> Object:
        query = f'sum(dflash_waiting_requests{{pod=~"{self.name}-.*"}})'
        trigger = {"type": "prometheus", "metadata": {"serverAddress": self.prometheus_url, "query": query, "threshold": "1"}}
        return {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": self.metadata(),
            "spec": {
                "scaleTargetRef": {"name": self.name},
                "minReplicaCount": self.replicas,
                "maxReplicaCount": 4 * self.replicas,
                "cooldownPeriod": 300,
                "triggers": [trigger],
            },
        }

    def pod_monitor(self) -> Object:
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": self.metadata(),
            "spec": {
                "selector": {"matchLabels": dict(self.labels)},
                "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
            },
        }

    def openai_patch(self) -> Object:
        """A strategic-merge patch adding dflash-openai beside tritonserver (the gateway routes OpenAI traffic to it)."""
        container = {
            "name": "openai",
            "image": self.image,
            "command": ["dflash-openai"],
            "args": ["--repo", f"/models/{self.repo_name}", "--triton-url", f"localhost:{GRPC_PORT}", "--port", str(OPENAI_PORT)],
            "ports": [{"name": "openai", "containerPort": OPENAI_PORT}],
            "readinessProbe": {"httpGet": {"path": "/v1/models", "port": "openai"}, "periodSeconds": 5},
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        }
        spec = {"template": {"spec": {"containers": [container]}}}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": self.name}, "spec": spec}

    def routes(self) -> list[Object]:
        parents = [{"name": self.gateway}]
        grpc_route = {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "GRPCRoute",
            "metadata": self.metadata(),
            "spec": {"parentRefs": parents, "rules": [{"backendRefs": [{"name": self.name, "port": GRPC_PORT}]}]},
        }
        pool = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": self.name}
        http_route = {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": self.metadata(),
            "spec": {
                "parentRefs": parents,
                "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}], "backendRefs": [pool]}],
            },
        }
        return [grpc_route, http_route]

    def inference_pool(self) -> Object:
        """The Inference Extension's pool: its endpoint picker reads the gauges and routes OpenAI requests."""
        return {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": self.metadata(),
            "spec": {
                "selector": {"matchLabels": dict(self.labels)},
                "targetPorts": [{"number": OPENAI_PORT}],
                "endpointPickerRef": {"name": f"{self.name}-epp", "port": {"number": 9002}},
            },
        }

    def trtllm_patch(self) -> Object:
        """A strategic-merge patch: the pod as the TensorRT-LLM container runs a --backend trtllm repository."""
        container = {
            "name": "triton",
            "command": [f"/models/{self.repo_name}/launch.sh"],
            "args": [f"--exit-timeout-secs={EXIT_TIMEOUT_SECONDS}", "--allow-metrics=true", "--allow-gpu-metrics=true"],
            "env": [{"name": "DFLASH_TRT_WORKDIR", "value": TRTLLM_WORKDIR}],
            "resources": {"requests": {"cpu": str(4 * self.gpus)}},  # the GPU limit is the base's
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "trtllm-repo", "mountPath": TRTLLM_WORKDIR}],
        }
        volumes = [{"name": "shm", "emptyDir": {"medium": "Memory"}}, {"name": "trtllm-repo", "emptyDir": {}}]
        spec = {"template": {"spec": {"containers": [container], "volumes": volumes}}}
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": self.name}, "spec": spec}

    def kserve(self) -> list[Object]:
        container = self.triton_container()
        container.update(
            name="kserve-container", args=[a.replace(f"/models/{self.repo_name}", "/mnt/models") for a in container["args"]]
        )
        for key in ("volumeMounts", "lifecycle", "startupProbe", "readinessProbe", "livenessProbe"):
            container.pop(key)  # KServe mounts the storage URI at /mnt/models and probes the server itself
        runtime = {
            "apiVersion": "serving.kserve.io/v1alpha1",
            "kind": "ServingRuntime",
            "metadata": self.metadata("-runtime"),
            "spec": {
                "supportedModelFormats": [{"name": "dflash-trt", "version": "1", "autoSelect": True}],
                "protocolVersions": ["v2", "grpc-v2"],
                "containers": [container],
            },
        }
        model = {
            "modelFormat": {"name": "dflash-trt"},
            "runtime": f"{self.name}-runtime",
            "storageUri": f"pvc://{self.name}-models/{self.repo_name}",
        }
        service = {
            "apiVersion": "serving.kserve.io/v1beta1",
            "kind": "InferenceService",
            "metadata": self.metadata(),
            "spec": {"predictor": {"minReplicas": self.replicas, "model": model}},
        }
        return [runtime, service]


def write_tree(deployment: Deployment, output: Path) -> list[Path]:
    """The base and every overlay under `output`; returns the directories kustomize renders."""
    base = output / "base"
    _write(base, "deployment.yaml", [deployment.deployment()])
    _write(base, "service.yaml", deployment.services())
    _write(base, "pdb.yaml", [deployment.disruption_budget()])
    _kustomization(base, ["deployment.yaml", "service.yaml", "pdb.yaml"])
    trtllm = deployment.backend == "trtllm"
    overlays: dict[str, dict[str, list[Object]]] = {"monitoring": {"podmonitor.yaml": [deployment.pod_monitor()]}}
    patches = {"gateway": ("openai-container.yaml", deployment.openai_patch)}
    if trtllm:
        overlays["trtllm"] = {}
        patches = {"trtllm": ("trtllm-container.yaml", deployment.trtllm_patch)}
    else:
        overlays |= {
            "hpa": {"hpa.yaml": [deployment.autoscaler()], "adapter-rules.yaml": [deployment.adapter_rules()]},
            "keda": {"scaledobject.yaml": [deployment.scaled_object()]},
            "gateway": {"routes.yaml": deployment.routes(), "inferencepool.yaml": [deployment.inference_pool()]},
        }
    rendered = [base]
    for name, files in overlays.items():
        directory = output / "overlays" / name
        for file, objects in files.items():
            _write(directory, file, objects)
        patch_files = []
        if name in patches:
            patch_file, patch = patches[name]
            _write(directory, patch_file, [patch()])
            patch_files = [patch_file]
        _kustomization(directory, ["../../base", *files], patch_files)
        rendered.append(directory)
    if trtllm:
        return rendered
    kserve = output / "overlays" / "kserve"
    _write(kserve, "kserve.yaml", deployment.kserve())
    _kustomization(kserve, ["kserve.yaml"])
    return [*rendered, kserve]


def _write(directory: Path, name: str, objects: list[Object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(yaml.safe_dump_all(objects, sort_keys=False))


def _kustomization(directory: Path, resources: list[str], patches: list[str] | None = None) -> None:
    body: Object = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}
    if patches:
        body["patches"] = [{"path": p} for p in patches]
    _write(directory, "kustomization.yaml", [body])


# --- validation -------------------------------------------------------------------------------------------------


def render(directory: Path) -> list[Object]:
    """`kubectl kustomize DIR` (offline), parsed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("rendering needs kubectl (its built-in kustomize); install kubectl")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def strict_schema(schema: Any) -> Any:  # noqa: ANN401 (a JSON schema)
    """The schema with unknown fields refused wherever Kubernetes' strict field validation refuses them: every
    object schema with properties and no `additionalProperties` or `x-kubernetes-preserve-unknown-fields`."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


def crd_schemas(crd_dir: Path) -> dict[tuple[str, str], Object]:
    """(apiVersion, kind) -> the served version's strict openAPIV3Schema, from CRD YAML files."""
    schemas = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schemas[(f"{group}/{version['name']}", kind)] = strict_schema(version["schema"]["openAPIV3Schema"])
    return schemas


def problems(objects: list[Object], versions: tuple[str, ...], crds: dict[tuple[str, str], Object]) -> list[str]:
    """What is wrong with each object, strictly: [] when every object is valid for every version."""
    try:
        import jsonschema
        import kubernetes_validate
    except ImportError:
        raise RuntimeError("validating needs kubernetes-validate: pip install 'dflash-trt[deploy]'") from None
    found = []
    for obj in objects:
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        if key in crds:
            errors = sorted(jsonschema.Draft7Validator(crds[key]).iter_errors(obj), key=lambda e: list(e.path))
            found += [f"{where}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors]
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                found.append(f"{where}: no schema for {key[0]} {key[1]} (Kubernetes {version}, nor a CRD given)")
                break
            except kubernetes_validate.ValidationError as error:
                found.append(f"{where} (Kubernetes {version}): {'.'.join(map(str, error.path))}: {error.message}")
    return found


def validate_tree(output: Path, versions: tuple[str, ...], crd_dir: Path | None) -> dict[Path, list[str]]:
    crds = crd_schemas(crd_dir) if crd_dir else {}
    directories = [output / "base", *sorted((output / "overlays").iterdir())]
    return {directory: problems(render(directory), versions, crds) for directory in directories}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-deploy", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    k8s = commands.add_parser("k8s", help="write a Kustomize base and overlays for a repository")
    k8s.add_argument("--repo", type=Path, required=True, help="the dflash-build repository to serve")
    k8s.add_argument("--image", required=True, help="a Triton image with dflash-trt installed (see the Dockerfile)")
    k8s.add_argument("--output", type=Path, required=True)
    k8s.add_argument("--name", default="dflash")
    k8s.add_argument("--replicas", type=int, default=2)
    k8s.add_argument("--gpus", type=int, help="GPUs per pod (default: 1 for TensorRT engines, 0 for ONNX Runtime)")
    k8s.add_argument("--models-image", help="copy the repository from this image's /models in an init container "
                     "(default: a PersistentVolumeClaim NAME-models holding it)")  # fmt: skip
    k8s.add_argument("--gateway", default="inference-gateway", help="the Gateway the routes attach to")
    k8s.add_argument("--prometheus-url", default="http://prometheus-operated.monitoring.svc:9090", help="for KEDA")
    check = commands.add_parser("validate", help="render every overlay and validate it strictly, offline")
    check.add_argument("output", type=Path)
    check.add_argument("--kubernetes", nargs="+", default=["1.30", "1.37"], help="versions to validate against")
    check.add_argument("--crds", type=Path, help="a directory of CustomResourceDefinition YAML files")
    args = parser.parse_args(argv)
    if args.command == "k8s":
        require_at_least(parser, {"--replicas": (args.replicas, 1), "--gpus": (0 if args.gpus is None else args.gpus, 0)})
    try:
        if args.command == "k8s":
            deployment = Deployment(args.repo, args.image, args.name, args.replicas, args.gpus, args.models_image,
                                    args.gateway, args.prometheus_url)  # fmt: skip
            for directory in write_tree(deployment, args.output):
                print(f"dflash-deploy: wrote {directory}")
            return 0
        failures = validate_tree(args.output, tuple(args.kubernetes), args.crds)
    except (FileNotFoundError, KeyError, RuntimeError) as error:
        print(f"dflash-deploy: error: {error}", file=sys.stderr)
        return 2
    for directory, found in failures.items():
        print(f"{directory}: {'ok' if not found else f'{len(found)} problems'}")
        for problem in found:
            print(f"  {problem}")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
