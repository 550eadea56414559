"""The server plumbing every service shares: taken ports fail loudly, and start-up errors are one line."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvserve.engine.model import ContextLengthError
from kvserve.rpc.errors import FailedPrecondition, InvalidArgument, Unavailable, status_of
from kvserve.rpc.metrics import outcome_of
from kvserve.rpc.server import Server, run_until_signal
from kvstore.errors import InvalidRequest
from tests.polling import wait_until
from tests.processes import catches


def test_a_taken_port_is_refused_not_shared() -> None:
    first = Server("127.0.0.1:0")
    port = first.start()
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            Server(f"127.0.0.1:{port}").start()
    finally:
        first.stop(0)


def test_a_taken_metrics_port_is_refused_before_serving() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = Server("127.0.0.1:0", metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError, match="cannot serve metrics on port"):
            server.start()
        assert server.port == 0


@pytest.mark.slow
@pytest.mark.parametrize("module", ["prefill_service", "decode_service"])
def test_a_missing_model_is_one_line_and_exit_2(module: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--model", str(tmp_path / "nothing"), "--listen",
                           "127.0.0.1:0", "--insecure"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no model at" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def own_signal_handlers() -> Iterator[None]:
    """run_until_signal installs SIGTERM/SIGINT handlers; pytest's come back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_signal_ends_the_main_loop_through_before_stop_then_stops_the_server() -> None:
    server = Server("127.0.0.1:0")
    server.start()
    loop_done = threading.Event()
    seen: list[str] = []

    def main_loop() -> None:  # as an engine's step loop: runs on the main thread until stopped
        seen.append(f"loop on main: {threading.current_thread() is threading.main_thread()}")
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert loop_done.wait(30)
        seen.append("loop ended")

    run_until_signal(server, before_stop=[lambda: (seen.append("before_stop"), loop_done.set())],
                     on_stop=[lambda: seen.append("on_stop")], main_loop=main_loop)
    assert seen[:2] == ["loop on main: True", "before_stop"]
    assert sorted(seen[2:]) == ["loop ended", "on_stop"]


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_main_loop_that_ends_by_itself_shuts_the_service_down() -> None:
    server = Server("127.0.0.1:0")
    port = server.start()
    seen: list[str] = []
    run_until_signal(server, before_stop=[lambda: seen.append("before_stop")],
                     on_stop=[lambda: seen.append("on_stop")], main_loop=lambda: None)
    assert seen == ["before_stop", "on_stop"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=1)


_BUSY_SERVICE = """
import sys, threading
from kvserve.rpc.server import Server, run_until_signal
from tests.polling import wait_until
from tests.processes import catches
server = Server("127.0.0.1:0")
server.start()
done = threading.Event()
def main_loop():  # Python bytecode all along, where handlers run
    print("ready", flush=True)
    while not done.is_set():
        sum(range(100))
run_until_signal(server, before_stop=[done.set], grace_s=0.1, main_loop=main_loop)
print("stopped", flush=True)
"""


@pytest.mark.parametrize("trial", range(4))
def test_a_burst_of_stop_signals_stops_a_service(trial: int) -> None:
    """SIGTERM from two sources at once (the kernel when `up` dies, and an operator) ran a second handler
    inside the first, which waited forever on a lock its own thread held (the service hung), or handlers
    nested until RecursionError."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_SERVICE], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        deadline, i = time.monotonic() + 1.0, 0
        while time.monotonic() < deadline and proc.poll() is None:  # signals while the first is handled
            os.kill(proc.pid, signal.SIGINT if i % 7 == 3 else signal.SIGTERM)
            i += 1
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out == "stopped\n"  # run_until_signal returned; signals still coming may end the exit itself
    assert proc.returncode in (0, -signal.SIGTERM, -signal.SIGINT)


_HUNG_STOP = """
import threading, time
from kvserve.rpc.server import Server, run_until_signal
from tests.polling import wait_until
from tests.processes import catches
server = Server("127.0.0.1:0")
server.start()
threading.Thread(target=time.sleep, args=(3600,), name="stuck").start()  # joined at exit: forever
print("ready", flush=True)
run_until_signal(server, grace_s=0.1, exit_within_s=1.0)
"""


def test_a_stop_that_hangs_ends_within_its_bound_with_every_stack_in_stderr() -> None:
    """A process held after its stop (here a thread the interpreter joins at exit) would outlive `up` as
    an orphan on its ports; it exits with code 1 once the bound is past, saying where each thread was."""
    proc = subprocess.Popen([sys.executable, "-c", _HUNG_STOP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        wait_until(lambda: catches(proc.pid, signal.SIGTERM))  # "ready" comes just before the handler
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "Timeout" in err and "in _bootstrap" in err, err


_IDLE_ENGINE = """
import sys
from kvserve.engine.engine import Engine
from kvserve.engine.model import load_model
from kvserve.rpc.server import Server, run_until_signal
from tests.polling import wait_until
from tests.processes import catches
engine = Engine(load_model(sys.argv[1]), kv_cache_memory=1 << 20)
server = Server("127.0.0.1:0")
server.start()
print("ready", flush=True)
run_until_signal(server, before_stop=[engine.stop], grace_s=0.1, main_loop=engine.run)
print("stopped", flush=True)
"""


_TGKILL = {"x86_64": 234, "aarch64": 131}  # tgkill(2)'s number: a signal to one thread of a process


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in _TGKILL, reason="needs Linux's tgkill")
def test_an_idle_engine_stops_on_a_sigterm_the_kernel_handed_to_another_thread() -> None:
    """A process-wide signal goes to any thread that does not block it. Python runs the handler on the main
    thread only, where the engine loop waited, idle, with no timeout: a decode or prefill so signalled
    (by `docker stop`, or by the kernel when `up` died) never stopped, and outlived `up` as an orphan."""
    from tests.stack_fixtures import model_dir

    proc = subprocess.Popen([sys.executable, "-c", _IDLE_ENGINE, str(model_dir("llama"))], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        wait_until(lambda: catches(proc.pid, signal.SIGTERM))
        time.sleep(0.5)  # the engine is idle
        other = max(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        assert ctypes.CDLL(None, use_errno=True).syscall(_TGKILL[platform.machine()], proc.pid, other,
                                                         signal.SIGTERM) == 0
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out == "stopped\n" and proc.returncode == 0


class _NamesItsStatus(Exception):
    grpc_status = "NOT_FOUND"  # how domain code free of grpc names its status


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (FailedPrecondition("other model"), grpc.StatusCode.FAILED_PRECONDITION),
        (Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (_NamesItsStatus("gone"), grpc.StatusCode.NOT_FOUND),
        (ContextLengthError("too long"), grpc.StatusCode.OUT_OF_RANGE),
        (InvalidRequest("bad hash"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("a bug of ours"), grpc.StatusCode.INTERNAL),  # never the caller's INVALID_ARGUMENT
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_one_mapping_from_exception_to_status_and_outcome(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_of(exc) == code
    assert outcome_of(exc) == code.name.lower()


def test_outcome_of_a_request_that_ended_normally_or_was_abandoned() -> None:
    assert outcome_of(None) == "ok"
    assert outcome_of(GeneratorExit()) == "cancelled"


def _fail_with(exc: Exception) -> Callable[[object, grpc.ServicerContext], object]:
    def handler(request: object, context: grpc.ServicerContext) -> object:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "code", "details"),
    [
        (InvalidArgument("the prompt is empty"), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
        (ValueError("oops"), grpc.StatusCode.INTERNAL, "internal error: ValueError: oops"),
    ],
)
def test_the_interceptor_ends_an_rpc_with_the_mapped_status(exc: Exception, code: grpc.StatusCode, details: str) -> None:
    server = Server("127.0.0.1:0")
    handler = grpc.method_handlers_generic_handler(
        "test.Probe", {"Call": grpc.unary_unary_rpc_method_handler(_fail_with(exc))}
    )
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None, "test.Probe")
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Probe/Call", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                call(b"", timeout=10)
        assert info.value.code() == code  # type: ignore[attr-defined]
        assert info.value.details() == details  # type: ignore[attr-defined]
    finally:
        server.stop(0)


def test_bytes_that_are_not_the_request_message_get_invalid_argument(tmp_path: Path) -> None:
    # gRPC's own answer would be INTERNAL "Exception deserializing request!"; unary, client-streaming
    # and server-streaming methods all say which message they expected, and the server carries on.
    from tests.kvstore_fixtures import running_server

    garbage = b"\xff\xff\xff\xff"
    with running_server(tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        calls = {
            "Lookup": lambda: channel.unary_unary("/kvserve.v1.KVStore/Lookup")(garbage, timeout=5),
            "Put": lambda: channel.stream_unary("/kvserve.v1.KVStore/Put")(iter([garbage]), timeout=5),
            "Get": lambda: list(channel.unary_stream("/kvserve.v1.KVStore/Get")(garbage, timeout=5)),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert f"not a valid kvserve.v1.{method}Request message" in info.value.details(), info.value.details()
        stats = channel.unary_unary("/kvserve.v1.KVStore/Stats")(b"", timeout=5)  # an empty message is valid
        assert isinstance(stats, bytes)


COLLECTIONS = """
import gc, json, time
from kvserve.host.collector import collect_when_quiet

gc.set_threshold(100, 10)  # generation-1 collections come fast; Python's full one after ten of them
gc.collect()  # none pending from the imports
phase, calls, kept, full = ["busy"], [0], [], []
gc.callbacks.append(lambda stage, info: full.append((phase[0], gc.get_count()[2]))
                    if stage == "start" and info["generation"] == 2 else None)
collect_when_quiet(lambda: calls[0], every_s=0.05, at_most=30)

def gen1():
    return gc.get_stats()[1]["collections"]

def churn(name, collections=0, seconds=0.0):  # calls arriving, and cycles that age into the old generation
    phase[0] = name
    end, until = time.monotonic() + seconds, gen1() + collections
    while time.monotonic() < end or gen1() < until:
        cycle = []
        cycle.append(cycle)
        kept.append(cycle)
        if len(kept) > 500:
            kept.clear()
        calls[0] += 1

def quiet(name):
    phase[0] = name
    time.sleep(0.5)

churn("busy", collections=20)
quiet("quiet after 20")
churn("busy", collections=5)
quiet("quiet after 5")
churn("storm", seconds=1.0)
print(json.dumps(full))
"""


def test_full_collections_wait_for_a_moment_without_calls() -> None:
    """kvserve.host.collector.collect_when_quiet (in a process of its own: it sets the collector's thresholds).
    While calls keep coming, a full collection runs only once `at_most` generation-1 collections have passed;
    when none comes, once Python would have run one (ten of them)."""
    done = subprocess.run([sys.executable, "-c", COLLECTIONS], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=60, check=True)
    full = json.loads(done.stdout)  # (phase, generation-1 collections since the last full one) at each
    assert not [f for f in full if f[0] == "busy"], f"a full collection while calls came, before 30: {full}"
    assert [f[0] for f in full if f[0].startswith("quiet")] == ["quiet after 20"], \
        f"one full collection in half a second without calls, only with ten or more waiting: {full}"
    storm = [pending for name, pending in full if name == "storm"]
    assert len(storm) >= 2 and min(storm) >= 30, f"under a second of calls, a full collection after each 30: {full}"
