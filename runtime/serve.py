"""dflash-serve: run a real NVIDIA Triton Inference Server on a dflash-build model repository.

Uses the system `tritonserver` where one is installed (the NVIDIA Triton container), else the one bundled in
the `nvidia-pytriton` wheel, with the set-up that binary needs done here: a private Python-backend directory
holding the stub for this Python, this environment's `bin` first on PATH (so the stub's models import this
environment's packages), and libpython plus the wheel's own libraries on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from dflash_trt.builder.embedded import data_dir
from dflash_trt.builder.repository import UNARY_CONFIG, is_complete_repository, read_repository_manifest
from dflash_trt.runtime.options import port_number
from dflash_trt.runtime.repository import check_servable

SYSTEM_TRITON = Path("/opt/tritonserver")
WATCH_SECONDS = 0.5  # how often dflash-serve looks for a dead server or a dead backend stub


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    env: dict[str, str]


def check_bundled_numpy(numpy_version: str) -> None:
    """The tritonserver in nvidia-pytriton 0.7.0 (Triton 2.51) has a Python backend built before its NumPy 2 support
    (triton-inference-server/python_backend#384): under NumPy 2 its models' responses reach clients with empty
    output tensors (seen on a GPU machine whose image has NumPy 2.5). Refuse that pairing up front."""
    if int(numpy_version.split(".")[0]) >= 2:
        raise RuntimeError(
            f"NumPy {numpy_version} is installed, and the tritonserver bundled in nvidia-pytriton (Triton 2.51) has a "
            "Python backend that returns empty outputs under NumPy 2: install 'numpy<2' (dflash-trt requires it; an "
            "install without dependencies skips that) or serve in the NVIDIA Triton container"
        )


def _bundled_triton() -> TritonInstall:
    try:
        import pytriton
    except ImportError:
        raise RuntimeError(
            "no tritonserver found: pip install 'dflash-trt[serve]' (the tritonserver bundled in nvidia-pytriton) "
            "or run inside the NVIDIA Triton container"
        ) from None
    check_bundled_numpy(version("numpy"))
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton has no Python-backend stub for Python {python_version}; use Python 3.8-3.13")
    backend_dir = data_dir() / "triton-backends"
    python_backend = backend_dir / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    for source in [*(root / "backends" / "python").iterdir(), stub]:
        if source.is_file() and not (python_backend / source.name).exists():
            shutil.copy2(source, python_backend / source.name)
    libraries = [sysconfig.get_config_var("LIBDIR"), str(root.parent.parent / "nvidia_pytriton.libs")]
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "LD_LIBRARY_PATH": os.pathsep.join([*libraries, os.environ.get("LD_LIBRARY_PATH", "")]),
    }
    return TritonInstall(root / "bin" / "tritonserver", backend_dir, env)


def find_triton() -> TritonInstall:
    system = shutil.which("tritonserver") or (
        str(SYSTEM_TRITON / "bin" / "tritonserver") if (SYSTEM_TRITON / "bin").is_dir() else None
    )
    if system:
        return TritonInstall(Path(system), SYSTEM_TRITON / "backends", {})
    return _bundled_triton()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Ports:
    grpc: int
    http: int
    metrics: int


def start_server(
    repo: Path, ports: Ports, log_path: Path | None = None, unary: bool = False, cores: str | None = None
) -> subprocess.Popen[bytes]:
    """Start tritonserver on the repository (not waiting for readiness); `unary` serves the ensemble non-decoupled;
    `cores` (a taskset list, e.g. "0" or "2-3") pins it, and the engine then runs one thread per pinned core."""
    if not is_complete_repository(repo):
        raise FileNotFoundError(
            f"{repo} is not a complete dflash-build model repository (no dflash-manifest.json); run dflash-build first"
        )
    check_servable(read_repository_manifest(repo), repo)  # before tritonserver loads a model it cannot run
    triton = find_triton()
    command = [
        str(triton.binary), f"--model-repository={repo.resolve()}", f"--backend-directory={triton.backend_dir}",
        f"--grpc-port={ports.grpc}", f"--http-port={ports.http}", f"--metrics-port={ports.metrics}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-on-error=true", "--log-verbose=0",
    ]  # fmt: skip
    if unary:
        command.append(f"--model-config-name={UNARY_CONFIG}")
    if cores is not None:
        command = ["taskset", "-c", cores, *command]
    output = open(log_path, "wb") if log_path else None  # the child process owns it
    return subprocess.Popen(
        command, env={**os.environ, **triton.env}, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_ready(process: subprocess.Popen[bytes], http_port: int, timeout: float = 120.0) -> float:
    """Seconds until /v2/health/ready answers 200; raises if the server exits or the time runs out."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready (see its log)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return time.perf_counter() - began
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"tritonserver was not ready after {timeout:.0f} s")


STUB_COMMAND = "triton_python_b"  # a Python-backend stub's process name (the kernel keeps 15 characters)


def child_processes(parent_pid: int) -> list[tuple[int, str, str]]:
    """(pid, process name, state letter) of each process whose parent is `parent_pid`, read from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent_pid:  # stat fields 3 (state) and 4 (parent pid)
            children.append((int(entry.name), name, fields[0]))
    return children


def dead_backend_stubs(server_pid: int) -> list[int]:
    """Pids of the server's Python-backend stubs that died and were not reaped (zombies). tritonserver reaps a stub
    only when it unloads the model, and until then every request to that model fails or hangs while the server's
    health endpoints still answer ready (Triton 2.51): a server with a dead stub has to be restarted."""
    return [pid for pid, name, state in child_processes(server_pid) if state == "Z" and name.startswith(STUB_COMMAND)]


def stop_server(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM the server's process group, SIGKILL it if it does not exit in time; returns its exit code."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def kill_server(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server's whole process group (its stubs included) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-serve", description=__doc__)
    parser.add_argument("repo", type=Path, help="a dflash-build output directory")
    parser.add_argument("--grpc-port", type=port_number, default=8001)
    parser.add_argument("--http-port", type=port_number, default=8000)
    parser.add_argument("--metrics-port", type=port_number, default=8002)
    parser.add_argument(
        "--unary",
        action="store_true",
        help="serve the ensemble non-decoupled (tensorrtllm_backend's decoupled_mode false): unary gRPC infer and HTTP "
        "generate work, streaming requests are refused",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="run N tritonserver replicas behind a load balancer (--lb); --grpc-port and --http-port are then the "
        "balancer's, and each replica's ports and metrics are printed",
    )
    parser.add_argument("--lb", choices=["haproxy"], default="haproxy", help="the balancer in front of --replicas")
    parser.add_argument("--pin", action="store_true", help="with --replicas: pin replica i to core i (one thread each)")
    args = parser.parse_args(argv)
    if args.replicas != 1 or args.pin:
        return serve_fleet(args)
    try:
        process = start_server(args.repo, Ports(args.grpc_port, args.http_port, args.metrics_port), unary=args.unary)
        seconds = wait_ready(process, args.http_port)
    except (FileNotFoundError, RuntimeError, TimeoutError) as error:
        print(f"dflash-serve: error: {error}", file=sys.stderr)
        return 2
    print(f"dflash-serve: ready in {seconds:.1f} s", file=sys.stderr)
    print(
        f"  gRPC     localhost:{args.grpc_port}\n  HTTP     http://localhost:{args.http_port}\n  metrics  http://localhost:{args.metrics_port}/metrics"
    )
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        os.killpg(process.pid, signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    while True:
        try:
            code = process.wait(WATCH_SECONDS)
            return 0 if stopping else code
        except subprocess.TimeoutExpired:
            pass
        stubs = dead_backend_stubs(process.pid)
        if stubs and not stopping:
            print(f"dflash-serve: a Python-backend stub died (pid {stubs[0]}); restarting tritonserver", file=sys.stderr)
            kill_server(process)
            process = start_server(args.repo, Ports(args.grpc_port, args.http_port, args.metrics_port), unary=args.unary)
            try:
                print(f"dflash-serve: ready again in {wait_ready(process, args.http_port):.1f} s", file=sys.stderr)
            except (RuntimeError, TimeoutError) as error:
                print(f"dflash-serve: error: {error}", file=sys.stderr)
                kill_server(process)
                return 1


def serve_fleet(args: argparse.Namespace) -> int:
    """`--replicas N`: the fleet until SIGINT or SIGTERM; a replica that dies is reaped and started again."""
    import tempfile

    from dflash_trt.runtime.fleet import Fleet

    work_dir = Path(tempfile.mkdtemp(prefix="dflash-fleet-"))
    try:
        fleet = Fleet(args.repo, args.replicas, Ports(args.grpc_port, args.http_port, args.metrics_port), work_dir,
                      unary=args.unary, pin=args.pin)  # fmt: skip
    except ValueError as error:
        print(f"dflash-serve: error: {error}", file=sys.stderr)
        return 2
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        seconds = fleet.start()
        print(f"dflash-serve: {args.replicas} replicas behind {args.lb} ready in {seconds:.1f} s", file=sys.stderr)
        print(fleet.describe(), flush=True)
        while not stopping:
            for replica, why in fleet.reap():
                fleet.restart(replica)
                print(f"dflash-serve: {replica.name} {why}; started again, pid {replica.process.pid}", file=sys.stderr)
            time.sleep(WATCH_SECONDS)
    except (FileNotFoundError, RuntimeError, TimeoutError) as error:
        print(f"dflash-serve: error: {error}", file=sys.stderr)
        return 2
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
