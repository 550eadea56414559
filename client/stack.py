"""Runs the three services as local processes: what `kvserve up`, the demo and the benchmarks use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 120.0


class StackError(RuntimeError):
    pass


@dataclass
class Service:
    """One service process; `port` is read from the `LISTENING <port>` line it prints."""

    name: str
    process: subprocess.Popen[str]
    port: int
    log_path: Path | None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


def _drain(stream: IO[str], sink: IO[str] | None) -> None:
    for line in stream:
        if sink is not None:
            sink.write(line)
            sink.flush()


def start_service(
    name: str, module: str, args: Sequence[str], log_path: Path | None = None, timeout_s: float = START_TIMEOUT_S
) -> Service:
    """Starts `python -m module args...`, waits for its LISTENING line and for health SERVING."""
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - owned by the drain thread
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=log if log is not None else None,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    port: int | None = None
    deadline = time.monotonic() + timeout_s
    while port is None:
        line = proc.stdout.readline()
        if not line:
            raise StackError(f"{name} exited with code {proc.wait()} before listening"
                             + (f"; see {log_path}" if log_path else ""))
        if line.startswith("LISTENING "):
            port = int(line.split()[1])
        elif time.monotonic() > deadline:
            proc.kill()
            raise StackError(f"{name} did not start within {timeout_s:.0f} s")
    threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
    service = Service(name, proc, port, log_path)
    wait_healthy(service.addr, deadline - time.monotonic())
    return service


def wait_healthy(addr: str, timeout_s: float) -> None:
    deadline = time.monotonic() + max(timeout_s, 1.0)
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"{addr} is not healthy after {timeout_s:.0f} s")
            time.sleep(0.1)


def stop_service(service: Service, timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns its exit code."""
    if service.process.poll() is None:
        service.process.send_signal(signal.SIGTERM)
        try:
            service.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            service.process.kill()
    return service.process.wait()


@dataclass
class StackConfig:
    model_dir: Path
    data_dir: Path
    host: str = "127.0.0.1"
    decode_port: int = 50051
    prefill_port: int = 50052
    store_port: int = 50053
    metrics_base_port: int | None = None  # decode, prefill, store get base, base+1, base+2
    host_capacity: str = "1GiB"
    disk_capacity: str = "8GiB"
    block_size: int = 16
    extra_store_args: list[str] = field(default_factory=list)


class Stack:
    """The store, prefill and decode services as local processes, started in order."""

    def __init__(self, config: StackConfig, log_dir: Path | None = None) -> None:
        self.config = config
        self.log_dir = log_dir
        self.services: list[Service] = []

    def _metrics(self, offset: int) -> list[str]:
        base = self.config.metrics_base_port
        return [] if base is None else ["--metrics-port", str(base + offset)]

    def _log(self, name: str) -> Path | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{name}.log"

    def start(self) -> Stack:
        c = self.config
        try:
            store = start_service("kvstore", "kvstore", [
                "--listen", f"{c.host}:{c.store_port}", "--host-capacity", c.host_capacity,
                "--disk-capacity", c.disk_capacity, "--disk-path", str(c.data_dir / "kvstore"),
                *self._metrics(2), *c.extra_store_args,
            ], self._log("kvstore"))
            self.services.append(store)
            common = ["--model", str(c.model_dir), "--kvstore", store.addr, "--block-size", str(c.block_size)]
            prefill = start_service("prefill", "prefill_service", [
                *common, "--listen", f"{c.host}:{c.prefill_port}", *self._metrics(1),
            ], self._log("prefill"))
            self.services.append(prefill)
            decode = start_service("decode", "decode_service", [
                *common, "--prefill", prefill.addr, "--listen", f"{c.host}:{c.decode_port}", *self._metrics(0),
            ], self._log("decode"))
            self.services.append(decode)
        except BaseException:
            self.stop()
            raise
        return self

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    @property
    def addr(self) -> str:
        return self.service("decode").addr

    def stop(self) -> None:
        """Stops decode, then prefill, then the store (which flushes its memory tiers to disk)."""
        for service in reversed(self.services):
            stop_service(service)
        self.services.clear()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
