"""While `kvserve up` starts a killed service again: why it died (the kernel's OOM killer, from its cgroup's
count; the memory it held), a placeholder on its port that answers UNAVAILABLE with that reason instead of
"connection refused", and a client that waits for it, sends a request with no token yet once more, and quotes
it for a stream that broke. The classifier over fake /proc and cgroup files; the placeholder and the client over
in-process servers; then a real `up` whose decode is SIGKILLed under a client's loop of requests."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import AsyncClient, Client, KVServeError, UnavailableError
from client.client import SERVER_SAYS
from kvserve.stack.credentials import ensure as ensure_credentials
from kvserve.stack.memory import LOOKBACK_S, SAMPLE_S, Watch, held_bytes, kill_cause, oom_counter, size
from kvserve.stack.placeholder import Placeholder, restarting
from kvserve.stack.stack import ServiceSpec, port_in_use
from kvserve.stack.status import read_status
from tests.fake_decode import FakeServer
from tests.polling import wait_until
from tests.processes import KVSERVE, free_ports

MEMCG = "process_api/abc"  # where the fake service runs


def fake_process(proc: Path, pid: int, cgroup: str, pss_kb: int | None = 3_000, resident_pages: int = 1_000) -> None:
    """/proc/PID as the kernel shows it: its cgroups, smaps_rollup (left out: unreadable) and statm."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(cgroup)
    if pss_kb is not None:
        (proc / str(pid) / "smaps_rollup").write_text(f"Rss:  {2 * pss_kb} kB\nPss:  {pss_kb} kB\nPss_Anon:  1 kB\n")
    (proc / str(pid) / "statm").write_text(f"9000 {resident_pages} 200 1 0 800 0\n")


def memory_events(path: Path, oom_kills: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"low 0\nhigh 0\nmax 12\noom 2\noom_kill {oom_kills}\noom_group_kill 0\n")
    return path


@pytest.fixture()
def v2(tmp_path: Path) -> tuple[Path, Path, Path]:
    """/proc, /sys/fs/cgroup and the memory.events of pid 123's cgroup (v2), 3 kills so far."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    fake_process(proc, 123, f"0::/{MEMCG}\n")
    return proc, cgroups, memory_events(cgroups / MEMCG / "memory.events", 3)


def test_a_kill_that_raised_the_cgroup_oom_count_was_the_oom_killer(v2: tuple[Path, Path, Path]) -> None:
    proc, cgroups, events = v2
    watch = Watch(123, proc, cgroups)
    assert watch.poll(0.0) and watch.held == 3_000 * 1024
    memory_events(events, 4)  # the kernel counts its kill, then sends SIGKILL
    cause = watch.cause()
    assert cause.oom and cause.short == "killed: out of memory"
    assert cause.text == f"the kernel's OOM killer (oom_kill 3 → 4 in {events}); it held 3 MiB"


def test_a_kill_that_left_the_count_alone_was_not(v2: tuple[Path, Path, Path]) -> None:
    proc, cgroups, events = v2
    watch = Watch(123, proc, cgroups)
    watch.poll(0.0)
    cause = watch.cause()
    assert not cause.oom and cause.short == "killed by SIGKILL"
    assert cause.text == f"not the kernel's OOM killer (oom_kill 3 in {events}, unchanged); it held 3 MiB"


def test_a_count_read_while_the_kill_frees_the_memory_is_not_the_one_compared(v2: tuple[Path, Path, Path]) -> None:
    """The kernel raises the count, then the process runs on for a while as its memory is freed: `up`'s polls read
    the raised count before they see it dead. The kill is judged against a count LOOKBACK_S older."""
    proc, cgroups, events = v2
    watch = Watch(123, proc, cgroups)
    for t in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0):
        watch.poll(t)
    memory_events(events, 4)
    fake_process(proc, 123, f"0::/{MEMCG}\n", pss_kb=10)  # its memory going
    watch.poll(3.2, sample=True)  # the raised count, and less memory, read before the process is seen dead
    cause = watch.cause()
    assert cause.oom and "oom_kill 3 → 4" in cause.text
    assert cause.text.endswith("; it held 3 MiB")  # the larger of the last two samples
    for t in (4.0, 3.2 + LOOKBACK_S):  # that kill is LOOKBACK_S past: a kill now is judged after it
        watch.poll(t)
    assert not watch.cause().oom


def test_cgroup_v1_counts_kills_in_memory_oom_control(tmp_path: Path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    fake_process(proc, 7, f"9:name=systemd:/\n4:memory:/{MEMCG}\n1:cpu:/\n0::/\n", pss_kb=None, resident_pages=2560)
    counter = cgroups / "memory" / MEMCG / "memory.oom_control"
    counter.parent.mkdir(parents=True)
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert oom_counter(7, proc, cgroups) == counter
    watch = Watch(7, proc, cgroups)
    watch.poll(0.0)
    assert watch.held == 2560 * os.sysconf("SC_PAGE_SIZE")  # no smaps_rollup: the resident set
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert watch.cause().text == f"the kernel's OOM killer (oom_kill 0 → 1 in {counter}); it held {size(watch.held)}"


def test_without_a_readable_count_only_the_memory_is_said(tmp_path: Path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    fake_process(proc, 9, "0::/\n")  # the root cgroup has no memory.events
    assert oom_counter(9, proc, cgroups) is None
    watch = Watch(9, proc, cgroups)
    watch.poll(0.0)
    assert watch.cause().text == "no OOM count readable to tell whether the kernel's OOM killer did it; it held 3 MiB"
    assert kill_cause(None, None).text == "no OOM count readable to tell whether the kernel's OOM killer did it"
    assert held_bytes(10, proc) is None  # gone
    assert [size(n) for n in (310 << 20, 2_900 << 20)] == ["310 MiB", "2.8 GiB"]


def test_a_process_moved_to_another_cgroup_is_judged_by_that_cgroup(v2: tuple[Path, Path, Path]) -> None:
    proc, cgroups, _ = v2
    watch = Watch(123, proc, cgroups)
    watch.poll(0.0)
    other = memory_events(cgroups / "tests" / "memory.events", 0)
    fake_process(proc, 123, "0::/tests\n")
    watch.poll(SAMPLE_S, sample=True)
    memory_events(other, 1)
    assert watch.cause().text.startswith(f"the kernel's OOM killer (oom_kill 0 → 1 in {other})")


# -- the placeholder ---------------------------------------------------------------------------------------------


def _check(addr: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.RpcError:
    channel = grpc.insecure_channel(addr) if credentials is None else grpc.secure_channel(addr, credentials)
    with channel, pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return info.value


def test_a_placeholder_answers_unavailable_with_why_and_holds_the_port_for_the_service_only() -> None:
    port = free_ports(1)[0]
    spec = ServiceSpec("decode", "decode_service", ("--listen", f"127.0.0.1:{port}", "--insecure"), None, "127.0.0.1")
    placeholder = Placeholder.open(spec, restarting("decode", "killed: out of memory"))
    assert placeholder is not None
    try:
        refused = _check(f"127.0.0.1:{port}")
        assert refused.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert refused.details() == "decode restarting (killed: out of memory); retry in a few seconds"  # type: ignore[attr-defined]
        assert ("retry-after-ms", "1000") in refused.trailing_metadata()  # type: ignore[attr-defined]
        placeholder.message = restarting("decode", "failed to start again: killed: out of memory")
        assert "failed to start again" in _check(f"127.0.0.1:{port}").details()  # type: ignore[attr-defined]
        # Nobody else may take the port; `up` tells its own placeholder from another process, and the service it
        # starts again (SO_REUSEPORT, as KVSERVE_SHARE_PORT has it) binds beside it.
        assert port_in_use("127.0.0.1", port) and not port_in_use("127.0.0.1", port, shared=True)
        server = grpc.server(futures.ThreadPoolExecutor(1), options=[("grpc.so_reuseport", 0)])
        with pytest.raises(RuntimeError):
            server.add_insecure_port(f"127.0.0.1:{port}")
        again = grpc.server(futures.ThreadPoolExecutor(1), options=[("grpc.so_reuseport", 1)])
        assert again.add_insecure_port(f"127.0.0.1:{port}") == port
        again.start()  # a server that never started keeps its port
        again.stop(None).wait()
    finally:
        placeholder.close()
    assert not port_in_use("127.0.0.1", port)
    placeholder.close()  # once is enough; again does nothing


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_a_placeholder_speaks_the_services_tls(tmp_path: Path, name: str) -> None:
    """The front door asks for no certificate; the internal services take only callers with one from the CA."""
    layout, _ = ensure_credentials(tmp_path)
    port = free_ports(1)[0]
    spec = ServiceSpec(name, "x", ("--listen", f"127.0.0.1:{port}", *layout.tls_flags(name)), None, "127.0.0.1")
    placeholder = Placeholder.open(spec, restarting(name, "killed by SIGKILL"))
    assert placeholder is not None
    try:
        addr, ca = f"127.0.0.1:{port}", layout.ca.read_bytes()
        admin = _check(addr, layout.admin_credentials())
        assert admin.details() == f"{name} restarting (killed by SIGKILL); retry in a few seconds"  # type: ignore[attr-defined]
        tenant = _check(addr, grpc.ssl_channel_credentials(ca))  # no client certificate
        assert (tenant.details() == admin.details()) == (name == "decode"), tenant  # type: ignore[attr-defined]
    finally:
        placeholder.close()


@pytest.mark.parametrize("secure", [False, True])
def test_the_http_apis_placeholder_answers_503_with_why_and_retry_after(tmp_path: Path, secure: bool) -> None:
    layout, _ = ensure_credentials(tmp_path)
    port = free_ports(1)[0]
    flags = layout.tls_flags("http") if secure else ["--insecure"]
    spec = ServiceSpec("http", "kvserve.http", ("--listen", f"127.0.0.1:{port}", *flags), None, "127.0.0.1", "/health")
    placeholder = Placeholder.open(spec, restarting("http", "killed by SIGKILL"))
    assert placeholder is not None
    context = ssl.create_default_context(cafile=str(layout.ca)) if secure else None
    try:
        for data in (None, b'{"model": "m", "messages": []}' * 100):
            url = f"{'https' if secure else 'http'}://127.0.0.1:{port}/v1/chat/completions"
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=5, context=context)
            assert info.value.code == 503 and info.value.headers["Retry-After"] == "1"
            assert json.loads(info.value.read())["error"] == {
                "message": "http restarting (killed by SIGKILL); retry in a few seconds",
                "type": "service_unavailable_error", "param": None, "code": "restarting"}
        assert port_in_use("127.0.0.1", port) and not port_in_use("127.0.0.1", port, shared=True)
    finally:
        placeholder.close()
    assert not port_in_use("127.0.0.1", port)


# -- the client ----------------------------------------------------------------------------------------------------


def test_a_request_refused_unavailable_is_sent_once_more_and_no_more() -> None:
    with FakeServer() as fake:
        fake.servicer.refuse, fake.servicer.retry_after_ms = grpc.StatusCode.UNAVAILABLE, 200
        began = time.monotonic()
        with Client(fake.addr, timeout_s=10, token="") as c, pytest.raises(UnavailableError):
            c.generate("hi", max_tokens=2)
        assert len(fake.servicer.requests) == 2 and time.monotonic() - began >= 0.2  # after the server's hint
        with Client(fake.addr, timeout_s=0.15, token="") as c, pytest.raises(UnavailableError):
            c.generate("hi", max_tokens=2)  # no time left for the hint: not sent again
        assert len(fake.servicer.requests) == 3


def test_the_async_client_sends_it_once_more_too() -> None:
    import asyncio

    async def generate(addr: str) -> None:
        async with AsyncClient(addr, timeout_s=10, token="") as c:
            await c.generate("hi", max_tokens=2)

    with FakeServer() as fake:
        fake.servicer.refuse, fake.servicer.retry_after_ms = grpc.StatusCode.UNAVAILABLE, 50
        with pytest.raises(UnavailableError):
            asyncio.run(generate(fake.addr))
        assert len(fake.servicer.requests) == 2


class _Restarting(health_pb2_grpc.HealthServicer):
    """As a restart's placeholder answers: UNAVAILABLE, why, and a retry hint (which gRPC's own UNAVAILABLE lacks)."""

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> None:  # noqa: N802
        context.set_trailing_metadata((("retry-after-ms", "1000"),))
        context.abort(grpc.StatusCode.UNAVAILABLE, restarting("decode", "killed: out of memory"))


def test_a_stream_that_broke_after_a_token_is_not_sent_again_and_says_what_the_server_says() -> None:
    fake = FakeServer()
    health_pb2_grpc.add_HealthServicer_to_server(_Restarting(), fake.server)
    with fake:
        fake.servicer.die_after = 2
        with Client(fake.addr, timeout_s=10, token="") as c, pytest.raises(UnavailableError) as info:
            c.generate("hi", max_tokens=4)
        assert len(fake.servicer.requests) == 1
        assert info.value.details == ("Socket closed" + SERVER_SAYS +
                                      "decode restarting (killed: out of memory); retry in a few seconds")


def test_the_cli_quotes_what_the_server_says_and_probes_nothing() -> None:
    from kvserve.cli.diagnose import Dialed, explain

    broke = "Socket closed" + SERVER_SAYS + restarting("decode", "killed: out of memory")
    dialed = Dialed("127.0.0.1:1", tls=True)  # nothing listens there: a probe would say so
    assert explain(dialed, grpc.StatusCode.UNAVAILABLE, broke) == f"UNAVAILABLE: {broke}"
    placeholder = restarting("decode", "killed: out of memory")
    assert explain(dialed, grpc.StatusCode.UNAVAILABLE, placeholder) == f"UNAVAILABLE: {placeholder}"


# -- a real `kvserve up` -------------------------------------------------------------------------------------------


def _restarted(proc: subprocess.Popen[str], err: list[str], data: Path, name: str, pid: int) -> bool:
    assert proc.poll() is None, "".join(err)
    now = read_status(data)
    return now is not None and now.services[name].state == "running" and now.services[name].pid != pid


@pytest.mark.slow
def test_clients_looping_through_restarts_hear_why_and_never_connection_refused(
        up: tuple[subprocess.Popen[str], list[str], list[str], Path, list[int]]) -> None:
    """Decode SIGKILLed under a client's loop of requests; then the HTTP API under a loop of health checks."""
    proc, out, err, data, ports = up
    assert sum("MiB resident)" in line or "GiB resident)" in line for line in out) == 4, out  # "decode ready on ..."
    outcomes, pid = _kill_decode_under_a_loop_of_requests(proc, err, data, ports[0])
    line = next(line for line in err if line.startswith(f"kvserve up: decode (pid {pid}) was killed by SIGKILL"))
    assert "OOM" in line and "it held " in line, line  # killed by the test: "not the kernel's OOM killer (...)"
    failed = [o for o in outcomes if o[0] != "ok"]
    assert failed, "the restart takes seconds: some requests came while it ran"
    assert not [o for o in failed if "refused" in o[1].lower()], failed
    says = "decode restarting (killed by SIGKILL); retry in a few seconds"
    assert all(code == "UNAVAILABLE" and details.endswith(says) for code, details in failed), failed
    assert outcomes[-3:] == [("ok", "")] * 3
    _check_stats_say_why_decode_exited(data, line)
    _check_a_killed_http_api_answers_why(proc, err, data)


def _kill_decode_under_a_loop_of_requests(proc: subprocess.Popen[str], err: list[str], data: Path, port: int
                                          ) -> tuple[list[tuple[str, str]], int]:
    """SIGKILLs decode while a client loops over requests, until three after its restart succeed: the
    outcomes, ("ok", "") or (code, details), and the killed pid."""
    outcomes: list[tuple[str, str]] = []
    stop = threading.Event()

    def loop() -> None:
        with Client(f"127.0.0.1:{port}", timeout_s=60) as client:  # finds up's CA and admin token
            while not stop.is_set():
                try:
                    client.generate("The decode service was killed, and yet", max_tokens=8, ignore_eos=True)
                    outcomes.append(("ok", ""))
                except KVServeError as exc:
                    outcomes.append((exc.code.name, exc.details))

    looping = threading.Thread(target=loop)
    looping.start()
    try:
        wait_until(lambda: len(outcomes) >= 2, 60, message=lambda: str(outcomes))
        before = read_status(data)
        assert before is not None
        pid = before.services["decode"].pid
        assert pid is not None and (before.services["decode"].memory_bytes or 0) > 1 << 20
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: _restarted(proc, err, data, "decode", pid), 180, interval_s=0.1,
                   message=lambda: "".join(err))
        n = len(outcomes)
        wait_until(lambda: outcomes[n:].count(("ok", "")) >= 3, 60, message=lambda: str(outcomes[n:]))
    finally:
        stop.set()
        looping.join(timeout=120)
    return outcomes, pid


def _check_stats_say_why_decode_exited(data: Path, line: str) -> None:
    """`kvserve stats`, as JSON and as text, shows decode's memory and the cause `up` printed in `line`."""
    stats = subprocess.run([KVSERVE, "stats", "--data-dir", str(data), "--json"], capture_output=True, text=True,
                           timeout=60)
    assert stats.returncode == 0, stats.stderr
    decode = json.loads(stats.stdout)["up"]["services"]["decode"]
    assert decode["memory_bytes"] > 1 << 20 and decode["last_exit"]["cause"] in line, decode
    text = subprocess.run([KVSERVE, "stats", "--data-dir", str(data)], capture_output=True, text=True, timeout=60)
    row = next(r for r in text.stdout.splitlines() if r.startswith("decode "))
    assert row.split()[6] in ("MiB", "GiB") and "killed by SIGKILL: " in row and "OOM" in row, text.stdout


def _check_a_killed_http_api_answers_why(proc: subprocess.Popen[str], err: list[str], data: Path) -> None:
    """The HTTP API SIGKILLed under a loop of health checks: a 503 that says why while it restarts, and
    connections dropped only until `up` sees it die."""
    http = read_status(data)
    assert http is not None and http.http_url is not None and (http_pid := http.services["http"].pid) is not None
    answers: list[tuple[float, str]] = []  # (seconds since the kill, answer)
    context = ssl.create_default_context(cafile=str(data / "certs" / "ca.pem"))
    os.kill(http_pid, signal.SIGKILL)
    killed = time.monotonic()
    while not answers or not _restarted(proc, err, data, "http", http_pid) or answers[-1][1] != "200":
        try:
            with urllib.request.urlopen(f"{http.http_url}/health", timeout=5, context=context) as reply:
                answer = str(reply.status)
        except urllib.error.HTTPError as exc:
            answer = f"{exc.code} {json.loads(exc.read())['error']['message']}"
        except urllib.error.URLError as exc:
            answer = str(exc.reason)
        answers.append((time.monotonic() - killed, answer))
        time.sleep(0.02)
    says = "503 http restarting (killed by SIGKILL); retry in a few seconds"
    assert says in {a for _, a in answers}, answers
    # As it dies, and until `up` sees it (it looks every 0.2 s), nothing answers on the port: connections are reset
    # or refused (an HTTP client retries those itself); from then on, the placeholder or the new process answers.
    dropped = [t for t, a in answers if a not in ("200", says)]
    assert max(dropped, default=0) < 0.5, [(round(t, 2), a[:60]) for t, a in answers if a != says]
