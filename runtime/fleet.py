"""A fleet on one machine: N tritonserver replicas of one repository behind HAProxy (`dflash-serve --replicas N`).

HAProxy balances per gRPC stream (HTTP/2 end to end, least connections), so each request, one stream, goes to
the replica with the fewest open streams; Triton's HTTP port is balanced likewise. Health checks ask each
replica's HTTP port for `/v2/health/ready` in HTTP/1 (`check-proto h1`: spoken as h2 to that port, every check
fails and every replica is marked down). A replica that stops answering is taken out within a second, and a
connection that fails is re-sent to another replica; a stream that breaks mid-request is the client's to retry
(`dflash_trt.client.triton_client` does). A replica that dies, or whose Python-backend stub dies, is killed with its
whole process group and started again; stopping the fleet stops every process of it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.runtime.serve import Ports, dead_backend_stubs, free_port, kill_server, start_server, wait_ready

HEALTH_CHECK = "inter 500 fall 1 rise 2"  # checked every 0.5 s, down after one failure, up after two successes


@dataclass
class Replica:
    name: str
    ports: Ports
    process: subprocess.Popen[bytes]
    log: Path
    cores: str | None
    reaped: bool = False  # its exit was seen and its process group killed

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def find_haproxy() -> str:
    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").is_file() else None)
    if path is None:
        raise RuntimeError("--replicas needs HAProxy: install Debian's package (apt-get install haproxy)")
    return path


def haproxy_config(front: Ports, replicas: list[Replica]) -> str:
    """gRPC (h2) and HTTP frontends on the fleet's ports, one backend server per replica for each."""
    grpc_servers = "\n".join(
        f"    server {r.name} 127.0.0.1:{r.ports.grpc} proto h2 check check-proto h1 port {r.ports.http} {HEALTH_CHECK}"
        for r in replicas
    )
    http_servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.ports.http} check {HEALTH_CHECK}" for r in replicas)
    checks = "    balance leastconn\n    option httpchk\n    http-check send meth GET uri /v2/health/ready\n"
    checks += "    retry-on conn-failure empty-response\n    option redispatch\n    retries 3\n"
    return (
        "global\n    maxconn 4096\n\n"
        "defaults\n    mode http\n    timeout connect 2s\n    timeout client 10m\n    timeout server 10m\n"
        "    timeout tunnel 10m\n\n"
        f"frontend grpc\n    bind :{front.grpc} proto h2\n    default_backend grpc_replicas\n\n"
        f"frontend http\n    bind :{front.http}\n    default_backend http_replicas\n\n"
        f"backend grpc_replicas\n{checks}{grpc_servers}\n\n"
        f"backend http_replicas\n{checks}{http_servers}\n"
    )


class Fleet:
    """Replicas and their balancer; `start()` returns once every replica is ready and the balancer answers."""

    def __init__(self, repo: Path, count: int, front: Ports, work_dir: Path, unary: bool = False, pin: bool = False) -> None:
        if count < 1:
            raise ValueError(f"--replicas {count}: a fleet needs at least one replica")
        self.repo, self.count, self.front, self.work_dir = repo, count, front, work_dir
        self.unary, self.pin = unary, pin
        self.replicas: list[Replica] = []
        self.balancer: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> float:
        began = time.perf_counter()
        haproxy = find_haproxy()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        cores = sorted(os.sched_getaffinity(0))
        for index in range(self.count):
            pinned = str(cores[index % len(cores)]) if self.pin else None
            ports = Ports(free_port(), free_port(), free_port())
            log = self.work_dir / f"replica{index}.log"
            process = start_server(self.repo, ports, log, unary=self.unary, cores=pinned)
            self.replicas.append(Replica(f"replica{index}", ports, process, log, pinned))
        for replica in self.replicas:
            wait_ready(replica.process, replica.ports.http, timeout - (time.perf_counter() - began))
        config = self.work_dir / "haproxy.cfg"
        config.write_text(haproxy_config(self.front, self.replicas))
        output = open(self.work_dir / "haproxy.log", "wb")  # the child process owns it
        self.balancer = subprocess.Popen(
            [haproxy, "-f", str(config), "-db"], stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_balancer(timeout - (time.perf_counter() - began))
        return time.perf_counter() - began

    def _wait_balancer(self, timeout: float) -> None:
        """Until the balancer's HTTP port answers ready (through a replica that its checks marked up)."""
        assert self.balancer is not None
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.balancer.poll() is not None:
                raise RuntimeError(f"haproxy exited with code {self.balancer.returncode} (see {self.work_dir}/haproxy.log)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.front.http}/v2/health/ready", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the balancer did not answer ready in {timeout:.0f} s")

    def reap(self) -> list[tuple[Replica, str]]:
        """Replicas that failed since the last call, and how: the server exited, or one of its Python-backend stubs
        died (the server then still answers ready). Their process groups (stubs included) are killed."""
        failed = []
        for replica in self.replicas:
            if replica.reaped:
                continue
            if not replica.alive:
                failed.append((replica, f"exited ({replica.process.returncode})"))
            elif stubs := dead_backend_stubs(replica.process.pid):
                failed.append((replica, f"lost a Python-backend stub (pid {stubs[0]})"))
        for replica, _ in failed:
            kill_server(replica.process)
            replica.reaped = True
        return failed

    def restart(self, replica: Replica) -> None:
        """Start a dead replica again on its ports (the balancer's checks take it back once it is ready)."""
        replica.process = start_server(self.repo, replica.ports, replica.log, unary=self.unary, cores=replica.cores)
        replica.reaped = False

    def stop(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every replica at once (their in-flight streams finish, still relayed by the balancer), then stop
        the balancer; anything left after `timeout` is killed. Exit codes by name (None: it had to be killed)."""
        for replica in self.replicas:
            if replica.alive:
                _signal_group(replica.process.pid, signal.SIGTERM)
        deadline = time.perf_counter() + timeout
        codes: dict[str, int | None] = {}
        for replica in self.replicas:
            try:
                codes[replica.name] = replica.process.wait(max(deadline - time.perf_counter(), 0.1))
            except subprocess.TimeoutExpired:
                codes[replica.name] = None
            _signal_group(replica.process.pid, signal.SIGKILL)  # stubs of a replica that was killed, or hung
        if self.balancer is not None:
            _signal_group(self.balancer.pid, signal.SIGUSR1)  # HAProxy's soft stop: exits once idle
            try:
                codes["haproxy"] = self.balancer.wait(5)
            except subprocess.TimeoutExpired:
                codes["haproxy"] = None
            _signal_group(self.balancer.pid, signal.SIGKILL)
        return codes

    def describe(self) -> str:
        lines = [f"  gRPC     localhost:{self.front.grpc}  (HAProxy, per-stream least connections)"]
        lines.append(f"  HTTP     http://localhost:{self.front.http}")
        for replica in self.replicas:
            pinned = f", core {replica.cores}" if replica.cores else ""
            lines.append(
                f"  {replica.name}: pid {replica.process.pid}, gRPC {replica.ports.grpc}, HTTP {replica.ports.http}, "
                f"metrics http://localhost:{replica.ports.metrics}/metrics{pinned}, log {replica.log}"
            )
        lines.append(f"  haproxy: pid {self.balancer.pid if self.balancer else '-'}, config {self.work_dir}/haproxy.cfg")
        return "\n".join(lines)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
