"""Real redis-server processes for the tests: one server, a Redis Cluster of masters, a TLS server.

Each runs in a folder of the test's tmp_path on free loopback ports, without persistence, and dies
with the process that started it (even by SIGKILL). Use them as context managers or stop them:

    with RedisServer.start(tmp_path) as redis:            # .url, .port, .client(), .cli(...)
        redis.stop(); redis.restart(); redis.kill()
    with redis_cluster(tmp_path) as cluster:              # .url names its first node
        ...

Tests that need one are marked `needs_redis`: skipped when redis-server is not on PATH.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.polling import wait_until
from tests.processes import free_ports

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None,
                                 reason="redis-server is not on PATH (`make setup` installs it)")
START_TIMEOUT_S = 15.0

# Asks for SIGKILL when its parent dies (PR_SET_PDEATHSIG survives exec), then becomes redis-server.
_EXEC_WITH_PARENT = "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.execv(sys.argv[1], sys.argv[1:])"


@dataclass
class RedisServer:
    """One redis-server on 127.0.0.1:`port`; with `tls`, that port speaks only TLS (certificates from
    `kvserve certs` in dir/certs, client certificates required)."""

    dir: Path
    port: int
    tls: bool = False
    extra: list[str] = field(default_factory=list)  # more redis-server flags
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, tmp_path: Path, *, tls: bool = False, extra: list[str] | None = None, name: str = "redis"
              ) -> RedisServer:
        """A running server in tmp_path/name, answering PING."""
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not on PATH (`make setup` installs it)")
        directory = tmp_path / name
        directory.mkdir(parents=True, exist_ok=True)
        if tls:
            from kvserve.rpc.certs import make_certs

            make_certs(directory / "certs", ["redis", "client"], keep_existing=True)
        for attempt in range(3):  # a free port can be taken between the pick and the bind
            server = cls(directory, free_ports(1)[0], tls, list(extra or []))
            try:
                server.start_process()
                return server
            except RuntimeError:
                server.kill()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def certs(self) -> Path:
        return self.dir / "certs"

    def tls_kwargs(self) -> dict[str, str]:
        """redis-py's TLS arguments for a client with the test certificate (empty without TLS)."""
        if not self.tls:
            return {}
        return {"ssl_ca_certs": str(self.certs / "ca.pem"), "ssl_certfile": str(self.certs / "client.pem"),
                "ssl_keyfile": str(self.certs / "client-key.pem")}

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, **{"socket_timeout": 5.0, **self.tls_kwargs(), **kwargs})

    def cli(self, *args: str) -> str:
        """One redis-cli command's output."""
        assert REDIS_CLI is not None
        tls = ([] if not self.tls else ["--tls", "--cacert", str(self.certs / "ca.pem"), "--cert",
                                        str(self.certs / "client.pem"), "--key", str(self.certs / "client-key.pem")])
        out = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *tls, *args], capture_output=True,
                             text=True, timeout=30, check=True)
        return out.stdout.strip()

    def pause(self, ms: int) -> None:
        """Every client's commands wait `ms` milliseconds (CLIENT PAUSE): a slow Redis."""
        self.cli("CLIENT", "PAUSE", str(ms), "ALL")

    def stop(self) -> None:
        """SIGTERM (nothing to save), then wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        """Stops it if running, then starts it again on the same port, empty."""
        self.stop()
        self.start_process()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _args(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.certs / "redis.pem"),
                     "--tls-key-file", str(self.certs / "redis-key.pem"), "--tls-ca-cert-file",
                     str(self.certs / "ca.pem")]
        return [*ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log"), *self.extra]

    def start_process(self) -> None:
        assert REDIS_SERVER is not None
        self.process = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_PARENT, REDIS_SERVER, *self._args()],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with self.client(socket_timeout=1.0, socket_connect_timeout=1.0) as probe:

            def answers() -> bool:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited: {self._log_tail()}")
                try:
                    return bool(probe.ping())
                except (redis.ConnectionError, redis.TimeoutError):
                    return False

            wait_until(answers, START_TIMEOUT_S, interval_s=0.02,
                       message=lambda: f"redis-server on port {self.port} did not answer: {self._log_tail()}")

    def _log_tail(self) -> str:
        log = self.dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


@dataclass
class RedisClusterServers:
    """Masters of one Redis Cluster, every slot assigned, no replicas."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        """The first node's: a cluster client learns the rest from it."""
        return self.nodes[0].url

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_cluster(tmp_path: Path, masters: int = 3) -> RedisClusterServers:
    """A cluster of `masters` servers in tmp_path/cluster-N, made with `redis-cli --cluster create`, once
    every node reports cluster_state:ok."""
    nodes: list[RedisServer] = []
    try:
        for i, bus in enumerate(free_ports(masters)):
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus),
                     "--cluster-node-timeout", "2000"]
            nodes.append(RedisServer.start(tmp_path, extra=extra, name=f"cluster-{i}"))
        nodes[0].cli("--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas", "0",
                     "--cluster-yes")
        wait_until(lambda: all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in nodes), START_TIMEOUT_S,
                   message="the cluster did not reach cluster_state:ok")
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return RedisClusterServers(nodes)
