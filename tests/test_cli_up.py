"""`kvserve up` when things go wrong: taken ports, a missing model, a signal while starting, a
service that dies, `up` itself killed. It must say what is wrong and leave no process behind."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import IO, TYPE_CHECKING

import grpc
import pytest

from tests.polling import wait_until
from tests.processes import KVSERVE, alive, children, free_ports, memfd_inodes

if TYPE_CHECKING:
    from kvserve.stack.status import UpStatus


def up_argv(tmp: Path, model: Path, ports: list[int], *extra: str) -> list[str]:
    decode, prefill, store = ports
    return [KVSERVE, "up", "--data-dir", str(tmp / "data"), "--model", str(model), "--decode-port", str(decode),
            "--prefill-port", str(prefill), "--store-port", str(store), "--no-http", *extra]


def run_up(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture()
def fake_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_up_refuses_ports_a_grpc_server_already_holds(tmp_path: Path, fake_model: Path) -> None:
    """gRPC servers bind with SO_REUSEPORT, so a second stack on the same ports would start and
    share them; `up` checks first and refuses, starting nothing."""
    ports = free_ports(3)
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    assert other.add_insecure_port(f"127.0.0.1:{ports[2]}") == ports[2]
    other.start()
    try:
        done = run_up(up_argv(tmp_path, fake_model, ports))
    finally:
        other.stop(0)
    assert done.returncode == 1, done.stderr
    assert f"store port {ports[2]} already in use" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "logs").exists()  # nothing was started


def test_up_refuses_a_taken_metrics_port(tmp_path: Path, fake_model: Path) -> None:
    import socket

    ports = free_ports(3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        base = s.getsockname()[1] - 1  # prefill's metrics port (BASE+1) is taken
        done = run_up(up_argv(tmp_path, fake_model, ports, "--metrics-base-port", str(base)))
    assert done.returncode == 1 and f"prefill metrics port {base + 1} already in use" in done.stderr, done.stderr


def test_up_refuses_taken_ports_before_building_a_model(tmp_path: Path) -> None:
    """Another `up` holds the ports: a second one with a data folder of its own says so at once, without
    building that folder's tiny model first."""
    ports = free_ports(3)
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    assert other.add_insecure_port(f"127.0.0.1:{ports[0]}") == ports[0]
    other.start()
    try:
        argv = up_argv(tmp_path, tmp_path, ports)
        done = run_up(argv[:argv.index("--model")] + argv[argv.index("--model") + 2:])  # up's own tiny model
    finally:
        other.stop(0)
    assert done.returncode == 1 and f"decode port {ports[0]} already in use" in done.stderr, done.stderr
    assert "building the tiny model" not in done.stdout and not (tmp_path / "data" / "models").exists()


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_up_refuses_a_model_folder_without_a_config(tmp_path: Path, kind: str) -> None:
    model = tmp_path / "no-model"
    if kind == "empty":
        model.mkdir()
    done = run_up(up_argv(tmp_path, model, free_ports(3)))
    what = "does not exist" if kind == "missing" else "has no config.json"
    assert done.returncode == 2 and f"no model at {model}: the folder {what}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "data" / "logs").exists()  # nothing was started


def test_up_takes_the_old_tls_flag_and_refuses_a_tokens_file_of_its_own(tmp_path: Path) -> None:
    """`up --tls` (TLS is the default now) still starts as before: here it gets as far as the model check.
    `--auth-tokens` is refused, saying where up keeps its tenants, before anything starts."""
    model = tmp_path / "no-model"
    done = run_up(up_argv(tmp_path, model, free_ports(3), "--tls"))
    assert done.returncode == 2 and f"no model at {model}: the folder does not exist" in done.stderr, done.stderr
    done = run_up(up_argv(tmp_path, model, free_ports(3), "--auth-tokens", str(tmp_path / "t")))
    assert done.returncode == 2, done.stderr
    assert f"up keeps its tenants in {tmp_path / 'data' / 'auth' / 'tokens'}" in done.stderr, done.stderr
    assert not (tmp_path / "data" / "logs").exists() and not (tmp_path / "data" / "certs").exists()


@pytest.mark.slow
def test_up_shows_why_a_service_did_not_start(tmp_path: Path) -> None:
    """A model the engine refuses (sliding window): the reason is on the terminal, not only in a log."""
    import json

    from tests.stack_fixtures import model_dir

    model = tmp_path / "sliding"
    model.mkdir()
    for f in model_dir("qwen2").iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((model_dir("qwen2") / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 32,
                                                   "max_window_layers": 0}))
    done = run_up(up_argv(tmp_path, model, free_ports(3)))
    assert done.returncode == 1
    assert "prefill exited with code 2 before listening" in done.stderr
    assert "prefill did not start" in done.stdout, done.stdout  # a failed start names the service
    assert "sliding window attention is in use" in done.stderr and "Traceback" not in done.stderr, done.stderr


_STARTED: list[int] = []  # every service pid seen, killed after each test whatever its outcome


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    yield
    for pid in _STARTED:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    _STARTED.clear()


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    return _start_on(tmp_path, free_ports(3), *extra)


def _start_on(tmp_path: Path, ports: list[int], *extra: str) -> subprocess.Popen[str]:
    from tests.stack_fixtures import model_dir

    return subprocess.Popen(up_argv(tmp_path, model_dir("llama"), ports, *extra), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_children(pid: int, n: int, timeout_s: float = 120) -> list[int]:
    def started() -> list[int]:  # each seen, so that _no_leftovers kills it should the test fail
        found = children(pid)
        _STARTED.extend(p for p in found if p not in _STARTED)
        return found if len(found) >= n else []

    return wait_until(started, timeout_s, message=lambda: f"{len(children(pid))} of {n} services started")


def _assert_gone(pids: list[int], timeout_s: float = 30) -> None:
    """Each of `pids` has exited; else the failure shows each one's command line (its log, in the test's
    data/logs, ends with its threads' stacks once its stop has run past rpc.cli.STOP_MARGIN_S)."""
    def orphans() -> str:
        return "orphans: " + "; ".join(f"{p} {Path(f'/proc/{p}/cmdline').read_text().replace(chr(0), ' ')[:300]}"
                                       for p in pids if alive(p))

    wait_until(lambda: not any(alive(p) for p in pids), timeout_s, interval_s=0.1, message=orphans)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_starting_stops_at_once(tmp_path: Path, sig: signal.Signals) -> None:
    proc = _start(tmp_path)
    started = _wait_children(proc.pid, 2)  # the store is up, prefill is loading the model
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"{sig.name} while starting" in err and "ready:" not in out and "Traceback" not in err
    assert "did not start" not in out + err, out + err  # an interrupted start is no failed one
    _assert_gone(started)


def _start_ready(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """`up` and its three services' pids, once it has printed "ready:", having said what it started."""
    proc = _start(tmp_path)
    services = _wait_children(proc.pid, 3)
    assert proc.stdout is not None
    lines = []
    while not lines or not lines[-1].startswith("ready:"):
        lines.append(proc.stdout.readline())
    progress = [line for line in lines if line.startswith(("prefill: ", "decode: "))]  # what a service is doing
    assert any("warmed up in" in line for line in progress), lines
    said = [line.split(" on ")[0] if " ready on " in line else line.strip() for line in lines
            if line not in progress][:6]
    assert said == ["starting kvstore ...", "kvstore ready", "starting prefill ...", "prefill ready",
                    "starting decode ...", "decode ready"], lines
    return proc, services


@pytest.mark.slow
def test_a_killed_up_leaves_no_orphans(tmp_path: Path) -> None:
    proc, services = _start_ready(tmp_path)
    proc.kill()
    proc.wait()
    _assert_gone(services)


@pytest.mark.slow
def test_a_burst_of_stop_signals_stops_up_and_its_services(tmp_path: Path) -> None:
    """Ctrl-C pressed again and again, SIGTERM from a supervisor besides: `up` stops everything once."""
    proc, services = _start_ready(tmp_path)
    deadline, i = time.monotonic() + 1.0, 0
    while time.monotonic() < deadline and proc.poll() is None:
        proc.send_signal(signal.SIGINT if i % 2 else signal.SIGTERM)
        i += 1
    out, err = proc.communicate(timeout=120)
    assert out.splitlines()[-1].startswith("stopped in ") and "Traceback" not in err, err
    assert "stopping decode ...\nstopping prefill ...\nstopping kvstore ...\n" in out, out
    _assert_gone(services)


class _Lines:
    """A stream's lines, read on a thread as they come."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(stream), daemon=True).start()

    def wait_for(self, text: str, proc: subprocess.Popen[str], timeout_s: float = 180) -> str:
        def found() -> list[str]:
            assert proc.poll() is None, f"`up` exited with {proc.returncode}:\n{''.join(self.lines)}"
            return [line for line in list(self.lines) if text in line]

        return wait_until(found, timeout_s, interval_s=0.1,
                          message=lambda: f"no {text!r} in:\n{''.join(self.lines)}")[0]


@pytest.mark.slow
def test_up_starts_each_killed_service_again_while_the_others_keep_serving(tmp_path: Path) -> None:
    """One `up`; its store, prefill and decode are SIGKILLed in turn. Each time `up` says which one died
    and its own last log lines, starts it again on its port, counts the restart in DATA_DIR/up.json and
    `kvserve stats`, and the next requests give the same tokens. A dead store's shm dir goes, and prefill
    and decode map the new store's arena instead of keeping the dead one's memory. `up` is secure, as by
    default: the client finds its credentials by itself, and the health checks present the admin certificate."""
    from kvserve.stack.status import read_status
    from tests.stack_fixtures import model_dir

    data = tmp_path / "data"
    (data / "logs").mkdir(parents=True)
    for name in ("kvstore", "prefill", "decode"):  # what an earlier run left: never quoted as the cause
        (data / "logs" / f"{name}.log").write_text(f"a stale line of an earlier {name}\n")
    ports = free_ports(3)
    # Every request crosses all three services: with local prefill, decode would answer this short prompt
    # alone, and prefill would map the new store's arena only at its next request.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVSERVE_DECODE_LOCAL_PREFILL_TOKENS": "0"}
    proc = subprocess.Popen(up_argv(tmp_path, model_dir("llama"), ports), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)
    seen: list[int] = []
    try:
        out.wait_for("ready:", proc)
        up = _RunningUp(proc, err, data, f"127.0.0.1:{ports[0]}")
        expected = up.generate()
        for name in ("kvstore", "prefill", "decode"):
            before = read_status(data)
            assert before is not None and before.pid == proc.pid
            seen.extend(s.pid for s in before.services.values() if s.pid)
            _kill_and_see_it_start_again(up, name, expected)
            _check_stats_json_counts_the_restart(data, proc.pid, name)
        _check_stats_text_counts_every_restart(data)
        final = read_status(data)
        assert final is not None
        seen.extend(s.pid for s in final.services.values() if s.pid)
    finally:
        _STARTED.extend(seen)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()  # its services get SIGTERM from the kernel (PR_SET_PDEATHSIG)
            proc.wait()
            raise
    assert proc.returncode == 0, "".join(err.lines)
    assert out.lines[-1].startswith("stopped in ")
    assert not (data / "up.json").exists()
    _assert_gone(seen)


@dataclasses.dataclass
class _RunningUp:
    proc: subprocess.Popen[str]
    err: _Lines
    data: Path
    front_door: str

    def generate(self) -> list[int]:
        from client.client import Client

        with Client(self.front_door, timeout_s=120) as client:  # no token, no CA: those `up` registered
            return list(client.generate(prompt="The store was killed, and yet", max_tokens=6,
                                        ignore_eos=True).token_ids)


def _kill_and_see_it_start_again(up: _RunningUp, name: str, expected: list[int]) -> None:
    """SIGKILLs `name`: `up` says so with its own last log lines, starts it again on its address (once, the
    others untouched), and the next requests give `expected`; a store comes back with a new arena."""
    from client.local import Layout
    from kvserve.stack.stack import wait_healthy
    from kvserve.stack.status import read_status

    before = read_status(up.data)
    assert before is not None
    pid = before.services[name].pid
    assert pid is not None
    others = {n: s.pid for n, s in before.services.items() if n != name}
    old_shm = list(Path("/dev/shm").glob(f"kvserve-{pid}-*")) if name == "kvstore" else []
    old_arena = memfd_inodes(pid) if name == "kvstore" else set()
    assert name != "kvstore" or (old_shm and old_arena)

    os.kill(pid, signal.SIGKILL)
    line = up.err.wait_for(f"kvserve up: {name} (pid {pid}) was killed by SIGKILL", up.proc)
    assert "starting it again in 0.5 s" in line and "its last log lines: " in line, line
    assert f" {name} " in line.partition("its last log lines: ")[2] and "stale" not in line, line
    if name == "kvstore":  # the cache is an optimisation: a request while it is down still works
        assert up.generate() == expected

    def running_again() -> UpStatus | None:
        assert up.proc.poll() is None, "".join(up.err.lines)
        now = read_status(up.data)
        return now if now is not None and now.services[name].state == "running" else None

    now = wait_until(running_again, timeout_s=180, interval_s=0.2, message=lambda: "".join(up.err.lines))
    assert now is not None
    again = now.services[name]
    assert again.restarts == 1 and again.pid not in (None, pid) and again.last_exit is not None
    assert again.last_exit.signal == "SIGKILL" and again.addr == before.services[name].addr
    assert {n: s.pid for n, s in now.services.items() if n != name} == others
    wait_healthy(again.addr, 60, credentials=Layout(up.data).admin_credentials())
    assert up.generate() == expected
    assert up.proc.poll() is None
    if name == "kvstore":
        assert again.pid is not None
        assert not any(d.exists() for d in old_shm)
        _check_clients_map_the_new_arena(up, now, again.pid, old_arena, expected)


def _check_clients_map_the_new_arena(up: _RunningUp, now: UpStatus, store_pid: int, old_arena: set[str],
                                     expected: list[int]) -> None:
    """The new store has its own shm dir and arena, and prefill and decode map it, not the dead one's."""
    assert list(Path("/dev/shm").glob(f"kvserve-{store_pid}-*"))
    new_arena = memfd_inodes(store_pid)
    assert new_arena and new_arena != old_arena
    clients = [p for n in ("prefill", "decode") if (p := now.services[n].pid)]

    def map_the_new_arena() -> bool:
        # a call during their channels' reconnect skips the store
        if all(memfd_inodes(p) == new_arena for p in clients):
            return True
        assert up.generate() == expected
        return False

    wait_until(map_the_new_arena, timeout_s=60, interval_s=0,
               message=lambda: str({p: memfd_inodes(p) for p in clients}))


def _check_stats_json_counts_the_restart(data: Path, up_pid: int, name: str) -> None:
    stats = subprocess.run([KVSERVE, "stats", "--data-dir", str(data), "--json"], capture_output=True,
                           text=True, timeout=60)
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    assert report["up"]["pid"] == up_pid and report["up"]["services"][name]["restarts"] == 1


def _check_stats_text_counts_every_restart(data: Path) -> None:
    text = subprocess.run([KVSERVE, "stats", "--data-dir", str(data)], capture_output=True, text=True,
                          timeout=60)
    assert text.returncode == 0, text.stderr
    rows = {row[0]: row for row in map(str.split, text.stdout.splitlines())
            if row and row[0] in ("kvstore", "prefill", "decode")}
    assert {name: (row[1], row[4]) for name, row in rows.items()} == {
        "kvstore": ("running", "1"), "prefill": ("running", "1"), "decode": ("running", "1")}, text.stdout

def _refuse_callers_without_a_certificate(ca: Path, ports: list[int]) -> None:
    """The store and prefill (`ports`) refuse plaintext, and TLS without a client certificate."""
    from protos.kvserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    for port in ports:
        for channel in (grpc.insecure_channel(f"127.0.0.1:{port}"), grpc.secure_channel(
                f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca.read_bytes()))):
            with channel, pytest.raises(grpc.RpcError) as refused:
                kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def _kvserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_up_is_secure_by_default_and_local_clients_find_its_credentials(tmp_path: Path) -> None:
    """`up` with no security flag, on a data dir where an operator made the credentials and a tenant's token
    (`kvserve credentials`, `kvserve token`): the front door serves TLS to a client with the CA and a token
    and refuses one without a token; `kvserve generate` and `Client` on this host, given neither, find the
    CA and the admin token that `up` registered; the store and prefill take no caller without a
    certificate from the CA; `kvserve stats --data-dir` reads the store with the admin certificate. When
    `up` stops, its registration goes."""
    from client import local
    from client.client import Client, UnauthenticatedError

    data = tmp_path / "data"
    made = _kvserve("credentials", str(data))
    assert made.returncode == 0, made.stderr
    layout = local.Layout(data)
    assert layout.complete()
    token = _kvserve("token", "team-a", "--tokens-file", str(layout.tokens))
    assert token.returncode == 0, token.stderr
    ports = free_ports(3)
    front_door = f"127.0.0.1:{ports[0]}"
    proc = _start_on(tmp_path, ports)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)
    try:
        ready = out.wait_for("ready:", proc)
        assert f"ready: front door at {front_door}, TLS, admin token in {layout.admin_token}" in ready, ready
        _wait_children(proc.pid, 3)
        found = local.find(front_door)
        assert found is not None and found.root == data.resolve()

        done = _kvserve("generate", "--addr", front_door, "--max-tokens", "4", "--ignore-eos", "--json", "hello")
        assert done.returncode == 0, done.stderr
        assert len(json.loads(done.stdout)["token_ids"]) == 4
        with Client(front_door, timeout_s=120) as c:  # the admin, found by itself
            assert len(c.generate(prompt="as the admin", max_tokens=4, ignore_eos=True).token_ids) == 4
        with Client(front_door, timeout_s=120, tls_ca=layout.ca, token=token.stdout.strip()) as c:
            assert len(c.generate(prompt="over TLS", max_tokens=4, ignore_eos=True).token_ids) == 4
        with Client(front_door, timeout_s=60, tls_ca=layout.ca, token="") as c, \
                pytest.raises(UnauthenticatedError):
            c.generate(prompt="no token", max_tokens=4)
        _refuse_callers_without_a_certificate(layout.ca, ports[1:])

        stats = _kvserve("stats", "--data-dir", str(data), "--json")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["kvstore"]["tiers"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 0, "".join(err.lines)
    assert all(local.find(f"127.0.0.1:{port}") is None for port in ports)


@pytest.mark.slow
def test_a_tenant_added_to_a_running_up_is_served_after_sighup(tmp_path: Path) -> None:
    """`kvserve token team-a --tokens-file DATA_DIR/auth/tokens`, then SIGHUP to `up` (passed on to decode):
    team-a is served with the CA and its token; before the SIGHUP its token is refused. The admin, whose
    token local clients find, is served throughout."""
    from client.client import Client, UnauthenticatedError

    ports = free_ports(3)
    front_door = f"127.0.0.1:{ports[0]}"
    proc = _start_on(tmp_path, ports)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)
    data = tmp_path / "data"
    try:
        out.wait_for("ready:", proc)
        token = _kvserve("token", "team-a", "--tokens-file", str(data / "auth" / "tokens"))
        assert token.returncode == 0, token.stderr
        with Client(front_door, timeout_s=120, tls_ca=data / "certs" / "ca.pem", token=token.stdout.strip()) as c:
            with pytest.raises(UnauthenticatedError):
                c.generate(prompt="a tenant", max_tokens=1)
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "reloaded" in (data / "logs" / "decode.log").read_text(), timeout_s=30)
            assert len(c.generate(prompt="a tenant", max_tokens=4, ignore_eos=True).token_ids) == 4
        done = _kvserve("generate", "--addr", front_door, "--max-tokens", "4", "--ignore-eos", "the admin")
        assert done.returncode == 0, done.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 0, "".join(err.lines)


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("reads /proc")


def test_port_check_passes_over_time_wait_of_a_stopped_server() -> None:
    """Right after a stack stops, its ports have connections in TIME_WAIT: not "in use"."""
    import socket

    from kvserve.stack.stack import port_in_use

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert port_in_use("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
    time.sleep(0.1)
    client.close()
    listener.close()
    assert not port_in_use("127.0.0.1", port)
