"""`kvserve up`'s supervisor (kvserve/stack/supervisor.py) over small fake services that start in a fraction of a
second: a dead service is reported with its own log lines and started again on its port with growing
delays; failures that last end `up`; the status file; and what a dead store leaves behind (its shm
dir, a client's mapping of its arena). tests/test_cli_up.py kills the real services."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.local import Layout
from kvserve.stack.stack import ServiceSpec, Stack, StackConfig, log_lines, remove_shm_leftovers
from kvserve.stack.status import STATUS_FILE, read_status
from kvserve.stack.supervisor import Supervisor, Unrecoverable
from protos.retry import Backoff
from tests.polling import wait_until
from tests.processes import free_ports, memfd_inodes

FAKE_SERVICE = '''
import argparse, os, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

p = argparse.ArgumentParser()
p.add_argument("--listen")
p.add_argument("--mode-file")
a = p.parse_args()
mode = open(a.mode_file).read().strip()
print(f"fake {mode} pid {os.getpid()}", file=sys.stderr, flush=True)
if mode == "crash":
    sys.exit(1)
if mode == "bad":
    print("fake: --frobnicate is not a flag", file=sys.stderr, flush=True)
    sys.exit(2)
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
port = server.add_insecure_port(a.listen)
server.start()
print(f"LISTENING {port}", flush=True)
threading.Event().wait()
'''


class Fakes:
    """Two fake services, "prefill" and "decode", in a Stack, watched by a Supervisor."""

    def __init__(self, tmp: Path, backoff: Callable[[], Backoff], **config: Any) -> None:
        self.tmp = tmp
        self.out, self.err = io.StringIO(), io.StringIO()
        # The fakes serve plaintext: their command lines carry no TLS flags, so up's health checks ask in plaintext
        # (`insecure=False` in `config` changes only what the status file says).
        self.stack = Stack(StackConfig(model_dir=tmp, data_dir=tmp, **{"insecure": True, **config}),
                           log_dir=tmp / "logs")
        self.mode = {name: tmp / f"{name}.mode" for name in ("prefill", "decode")}
        (tmp / "logs").mkdir()
        for name, mode in self.mode.items():
            mode.write_text("serve")
            (tmp / "logs" / f"{name}.log").write_text(f"an older {name} run's last words\n")
            self.stack.add(ServiceSpec(name, "fakesvc", ("--listen", "127.0.0.1:0", "--mode-file", str(mode)),
                                       tmp / "logs" / f"{name}.log", "127.0.0.1"))
        self.supervisor = Supervisor(self.stack, tmp / STATUS_FILE, backoff=backoff, out=self.out, err=self.err)

    def pid(self, name: str) -> int:
        return self.stack.service(name).process.pid

    def kill(self, name: str) -> int:
        proc = self.stack.service(name).process
        proc.kill()
        proc.wait()
        return proc.pid

    def poll_until(self, done: Callable[[], bool], timeout_s: float = 60) -> None:
        """Runs the supervisor's poll until `done()`."""

        def polled() -> bool:
            if done():
                return True
            self.supervisor.poll()
            return False

        wait_until(polled, timeout_s, interval_s=0.02,
                   message=lambda: f"gave up waiting; stderr so far:\n{self.err.getvalue()}")

    def state(self, name: str) -> str:
        return self.supervisor.status().services[name].state


@pytest.fixture()
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Fakes]]:
    (tmp_path / "fakesvc.py").write_text(FAKE_SERVICE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    made: list[Fakes] = []

    def make(backoff: Callable[[], Backoff] = Backoff, **config: Any) -> Fakes:
        made.append(Fakes(tmp_path, backoff, **config))
        return made[-1]

    yield make
    for f in made:
        f.stack.stop()
        f.supervisor.close()


def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    b = Backoff(initial_s=0.5, max_s=30.0, stable_s=60.0)
    assert [b.delay(None) for _ in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert b.delay(59.0) == 30  # a short run is still a crash loop
    assert b.delay(60.0) == 0.5
    assert b.delay(None) == 1


def test_a_killed_service_is_reported_with_its_own_lines_and_started_again_on_its_port(fakes: Callable[..., Fakes],
                                                                                      tmp_path: Path) -> None:
    f = fakes()
    decode_pid, port = f.pid("decode"), f.stack.service("prefill").port
    status = read_status(tmp_path)
    assert status is not None and status.pid == os.getpid()
    assert {n: (s.state, s.restarts) for n, s in status.services.items()} == {"prefill": ("running", 0),
                                                                             "decode": ("running", 0)}
    assert all(s.memory_bytes and s.memory_bytes > 1 << 20 for s in status.services.values())
    killed = f.kill("prefill")
    f.poll_until(lambda: f.state("prefill") == "waiting")
    line = f.err.getvalue()
    assert line.count("\n") == 1 and line.startswith(f"kvserve up: prefill (pid {killed}) was killed by SIGKILL after ")
    # Killed by the test, not the OOM killer; what the counters say depends on the machine's cgroups
    assert re.search(r" s: (not the kernel's OOM killer \(oom_kill \d+ in /sys/fs/cgroup/\S+, unchanged\)|no OOM count "
                     r"readable to tell whether the kernel's OOM killer did it); it held \d+ MiB; ", line), line
    assert f"its last log lines: fake serve pid {killed}" in line and "older" not in line, line
    assert "starting it again in 0.5 s" in line
    assert read_status(tmp_path).services["prefill"].pid is None  # type: ignore[union-attr]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)  # up's placeholder
    assert refused.value.details() == "prefill restarting (killed by SIGKILL); retry in a few seconds"  # type: ignore[attr-defined]

    f.poll_until(lambda: f.state("prefill") == "running")
    back = f.stack.service("prefill")
    assert back.port == port and back.process.pid != killed and f.pid("decode") == decode_pid
    assert re.fullmatch(rf"kvserve up: prefill is back on 127.0.0.1:{port} \(pid {back.process.pid}, restart 1, "
                        r"\d+ MiB resident\)\n", f.out.getvalue()), f.out.getvalue()
    on_disk = json.loads((tmp_path / STATUS_FILE).read_text())
    prefill = on_disk["services"]["prefill"]
    assert prefill["memory_bytes"] > 1 << 20 and prefill["last_exit"]["cause"] in line
    assert prefill | {"started_at": None, "memory_bytes": None} == {
        "state": "running", "pid": back.process.pid, "addr": f"127.0.0.1:{port}", "restarts": 1,
        "started_at": None, "log": str(tmp_path / "logs" / "prefill.log"), "metrics_url": None, "memory_bytes": None,
        "last_exit": {"code": None, "signal": "SIGKILL", "at": prefill["last_exit"]["at"],
                      "cause": prefill["last_exit"]["cause"]},
    }
    assert on_disk["services"]["decode"]["restarts"] == 0

    f.stack.stop()
    f.supervisor.close()
    assert not (tmp_path / STATUS_FILE).exists()


def test_a_service_that_keeps_failing_to_start_is_tried_again_with_growing_delays(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda: Backoff(initial_s=0.05, max_s=0.2))
    f.mode["decode"].write_text("crash")
    f.kill("decode")
    f.poll_until(lambda: f.err.getvalue().count("\n") == 4)  # the death, then three failed starts
    lines = f.err.getvalue().splitlines()
    assert "starting it again in 0.05 s" in lines[0]
    capped = "it keeps failing to start: trying again every 0.2 s until it starts or `up` is stopped"
    for attempt, then in [(1, "trying again in 0.1 s"), (2, capped), (3, capped)]:
        line = lines[attempt]
        assert line.startswith(f"kvserve up: decode failed to start again (attempt {attempt}): it exited with code 1 "
                               f"before listening; {then}; its last log lines: fake crash pid "), line
    f.mode["decode"].write_text("serve")
    f.poll_until(lambda: f.state("decode") == "running")
    assert f.supervisor.status().services["decode"].restarts >= 4


def test_exit_code_2_while_starting_ends_up(fakes: Callable[..., Fakes]) -> None:
    """Exit code 2 is how a service says its flags, model or port cannot work: retrying would not help."""
    f = fakes(lambda: Backoff(initial_s=0.05))
    f.mode["prefill"].write_text("bad")
    f.kill("prefill")
    with pytest.raises(Unrecoverable) as info:
        f.poll_until(lambda: False)
    assert str(info.value).startswith("cannot start prefill again: it exited with code 2 before listening")
    assert "fake: --frobnicate is not a flag" in str(info.value)


def test_a_port_taken_by_another_process_ends_up(fakes: Callable[..., Fakes]) -> None:
    """Taken before up's placeholder could hold it (once it does, nobody else can bind the port)."""
    f = fakes(lambda: Backoff(initial_s=0.5))
    port = f.stack.service("decode").port
    f.kill("decode")
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(Unrecoverable, match=f"cannot start decode again: port {port} on 127.0.0.1 is taken"):
            f.poll_until(lambda: False)


def test_stopping_while_a_service_starts_again_stops_it_too(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda: Backoff(initial_s=0.01))
    killed = f.kill("decode")
    f.poll_until(lambda: f.state("decode") == "starting")
    starting = f.stack.service("decode").process
    assert starting.pid != killed
    f.stack.stop()
    assert starting.poll() is not None


def test_only_a_dead_stores_shm_dirs_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dirs = [tmp_path / f"kvserve-{dead.pid}-0badc0de", tmp_path / f"kvserve-{alive.pid}-0badc0de",
                tmp_path / f"kvserve-{dead.pid}0-0badc0de"]
        for d in dirs:
            d.mkdir()
            (d / "arena.sock").touch()
        assert remove_shm_leftovers(dead.pid, tmp_path) == [dirs[0]]
        assert [d.exists() for d in dirs] == [False, True, True]
        assert remove_shm_leftovers(alive.pid, tmp_path) == [] and dirs[1].exists()
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.wait()


def test_log_lines_since_an_offset_are_one_process_own(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("old 1\nold 2\n")
    offset = log.stat().st_size
    assert log_lines(log, 3, offset) == []
    with open(log, "a") as f:
        f.write("new 1\n\nnew 2\nnew 3\nnew 4\n")
    assert log_lines(log, 3, offset) == ["new 2", "new 3", "new 4"]
    assert log_lines(log, 9, offset) == ["new 1", "new 2", "new 3", "new 4"]
    assert log_lines(tmp_path / "missing.log") == []


@pytest.mark.parametrize("insecure", [False, True])
def test_the_status_file_says_how_to_reach_each_service(fakes: Callable[..., Fakes], tmp_path: Path,
                                                        insecure: bool) -> None:
    """What a later command needs (`kvserve generate`, `stats`, `health` read it): each service's address and
    metrics page, and the CA and admin token of a secure up, or that it is insecure."""
    f = fakes(insecure=insecure, metrics_base_port=9100)
    up = read_status(tmp_path)
    assert up is not None
    layout, scheme = Layout(tmp_path.resolve()), "http" if insecure else "https"
    assert (up.insecure, up.credentials, up.ca, up.admin_token, up.http_url) == (
        (True, None, None, None, None) if insecure else
        (False, str(layout.root), str(layout.ca), str(layout.admin_token), None))
    assert {n: (s.addr, s.metrics_url) for n, s in up.services.items()} == {
        "prefill": (f.stack.service("prefill").addr, f"{scheme}://127.0.0.1:9101/metrics"),
        "decode": (f.stack.service("decode").addr, f"{scheme}://127.0.0.1:9100/metrics"),
    }
    port = f.stack.service("decode").port
    assert up.front_door == f"127.0.0.1:{port}" and up.serves(f"localhost:{port}")
    assert not up.serves(f"10.1.2.3:{port}") and not up.serves(f"127.0.0.1:{free_ports(1)[0]}")


def test_read_status_ignores_a_file_whose_up_has_died(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / STATUS_FILE).write_text(json.dumps(
        {"pid": dead.pid, "started_at": 0, "updated_at": 0, "front_door": "x:1", "services": {}}))
    assert read_status(tmp_path) is None
    (tmp_path / STATUS_FILE).write_text("{not json")
    assert read_status(tmp_path) is None


def test_a_client_maps_the_arena_of_a_store_started_again_after_a_call_failed(tmp_path: Path) -> None:
    """A client drops its mapping of a store's arena once the store has gone (its shm dir removed), so
    that its memory is freed, and maps the next store's. A call while the store was down used to leave
    the client without an arena for good: it went on sending bytes by gRPC to the new store."""
    from kvstore import KVStoreClient
    from kvstore.config import StoreConfig
    from kvstore.server import StoreServer
    from tests.kvstore_fixtures import key, payload

    config = StoreConfig(shm_root=str(tmp_path), host_capacity=1 << 20)
    first = StoreServer(config)
    port = first.start()
    with KVStoreClient(f"127.0.0.1:{port}") as looks, KVStoreClient(f"127.0.0.1:{port}") as puts:
        assert looks.put([(key(1), payload(1))]) == 1 and puts.put([(key(2), payload(2))]) == 1
        old_dir = looks.shm_dir()
        assert old_dir is not None and puts.shm_dir() == old_dir
        arena = memfd_inodes()
        first.stop(0.5)  # removes its shm dir and unmaps its arena
        assert memfd_inodes() == arena  # the clients still map it
        for call in (lambda: looks.lookup([key(1)]), lambda: puts.put([(key(3), payload(3))])):
            with pytest.raises(grpc.RpcError):  # down: UNAVAILABLE
                call()
        assert memfd_inodes() == set()  # its memory is freed
        second = StoreServer(config, f"127.0.0.1:{port}")
        second.start()
        try:
            for c in (looks, puts):

                def put(c: KVStoreClient = c) -> bool:  # the channel reconnects within a second
                    try:
                        c.put([(key(4), payload(4))])
                    except grpc.RpcError:
                        return False
                    return True

                wait_until(put, timeout_s=30, interval_s=0.1, message="the client never reached the new store")
                assert second.store.shm_tier is not None and c.shm_dir() == second.store.shm_tier.dir != old_dir
            assert memfd_inodes() == {next(iter(memfd_inodes()))}  # the new store's, mapped by all three
        finally:
            second.stop(0.5)
