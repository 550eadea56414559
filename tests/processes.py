"""Processes and ports on this machine, as tests of real processes see them: free loopback ports, a
process's children, whether it is alive, its memory, the shared-memory arenas it maps, a health probe, and the
`kvserve` command."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

KVSERVE = str(Path(sys.executable).with_name("kvserve"))


@contextlib.contextmanager
def openmp_as_deployed() -> Iterator[None]:
    """The services started inside wait for their OpenMP team as a deployed service does (OpenMP's own policy: a
    thread spins a while between kernels), not as the suite has them (conftest: OMP_WAIT_POLICY=PASSIVE, each
    kernel a wake-up, so that many idle engines spare the cores). A load test measures the deployment: under
    PASSIVE, a storm's refusals came at p50 0.27-0.66 s instead of 0.02-0.08 s."""
    saved = os.environ.pop("OMP_WAIT_POLICY", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved


def free_ports(n: int) -> list[int]:
    """n loopback ports free now (bound and closed again at once)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port_run(n: int) -> int:
    """The first of n consecutive loopback ports free now (`kvserve up --metrics-base-port` takes 3)."""
    while True:
        base = free_ports(1)[0]
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


class Up:
    """`kvserve up ARGS` as a process whose output is read as it comes: `ready` is set at its "ready:" line."""

    def __init__(self, args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([KVSERVE, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=cwd, env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ready:"):
                self.ready.set()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        assert self.ready.wait(timeout_s), f"kvserve up never got ready:\n{self.output()}"

    def stop(self) -> None:
        """SIGTERM, as Ctrl-C would; SIGKILL for what is left after 60 s (a test that failed half-way)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        for pid in [*children(self.proc.pid), self.proc.pid]:
            if alive(pid):
                os.kill(pid, 9)
        self.proc.wait(30)


@contextlib.contextmanager
def running_up(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> Iterator[Up]:
    """A ready `kvserve up ARGS`, stopped on the way out."""
    up = Up(args, cwd, env)
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


def catches(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler for `signum` (SigCgt in /proc): a signal sent before it has one kills it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def memfd_inodes(pid: int | str = "self") -> set[str]:
    """The shared-memory arenas (kvstore/arena.py) process `pid` maps, by inode."""
    return {line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/memfd:kvserve-arena" in line}


@dataclass
class HealthProbe:
    """Asks a service's health every `every_s`, with a `timeout_s` deadline, while a load runs: each answer's
    time, and every probe that failed or said anything but SERVING. With `command`, runs `kvserve health ADDR`
    as a process each time instead, as the Kubernetes and compose probes do."""

    addr: str
    every_s: float = 0.25
    command: bool = False
    timeout_s: float = 5.0  # the deployment's probes' (docs/OPERATIONS.md, "Probes")
    times: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _check(self, stub: health_pb2_grpc.HealthStub) -> str | None:
        """None when SERVING, otherwise what went wrong."""
        if self.command:
            try:
                done = subprocess.run([KVSERVE, "health", self.addr], capture_output=True, text=True,
                                      timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                return f"`kvserve health` took more than {self.timeout_s} s"
            return None if done.returncode == 0 else (done.stderr or done.stdout).strip()
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s).status
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        return None if status == health_pb2.HealthCheckResponse.SERVING else \
            health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def _run(self) -> None:
        with grpc.insecure_channel(self.addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.wait(self.every_s):
                t = time.perf_counter()
                failure = self._check(stub)
                self.times.append(time.perf_counter() - t)
                if failure is not None:
                    self.failures.append(failure)

    def __enter__(self) -> HealthProbe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        ordered = sorted(self.times) or [0.0]
        kind = "`kvserve health` probes" if self.command else "health probes"
        return (f"{len(self.times)} {kind}, {len(self.failures)} failed, p50 {ordered[len(ordered) // 2]:.3f} s, "
                f"max {ordered[-1]:.3f} s")


def rss_anon(pid: int) -> int:
    """Anonymous resident memory: what the process allocated. File pages it maps (the disk tier's LMDB
    file, read through mmap) are the kernel's page cache, and grow with what the disk tier holds."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for {pid}")
