"""Overload on one server: health answers however busy it is, a call past its limits is refused at once with a
retry hint, and the client library comes back after the hint. In-process servers; no model."""

from __future__ import annotations

import hashlib
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import Client, ResourceExhaustedError
from kvserve.rpc.admission import Admission
from kvserve.rpc.auth import Auth, Authenticator, TenantSalts
from kvserve.rpc.errors import ResourceExhausted
from kvserve.rpc.server import HEALTH_CHECK, PROBE_LIMIT, RESERVED_WORKERS, Server
from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from protos.retry import RETRY_AFTER, retry_after_s
from tests.processes import KVSERVE

DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


class Held(decode_pb2_grpc.DecodeServicer):
    """Streams one token, then holds the call until `release` is set; or refuses the first `refuse` calls as a
    busy server does (RESOURCE_EXHAUSTED, with `hint_s` as its retry hint unless None)."""

    def __init__(self, refuse: int = 0, hint_s: float | None = 0.05) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.calls = 0
        self.refuse, self.hint_s = refuse, hint_s

    def Generate(self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext  # noqa: N802
                 ) -> Iterator[decode_pb2.GenerateResponse]:
        self.calls += 1
        if self.calls <= self.refuse:
            raise ResourceExhausted("busy", retry_after_s=self.hint_s)
        self.started.release()
        yield decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=1, text="x"))
        self.release.wait(30)
        yield decode_pb2.GenerateResponse(result=decode_pb2.GenerateResult(
            finish_reason="length", token_ids=[1], usage=common_pb2.Usage(completion_tokens=1)))


def serve(servicer: Held, max_workers: int) -> tuple[Server, str]:
    server = Server("127.0.0.1:0", max_workers=max_workers, name="test")
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, DECODE)
    return server, f"127.0.0.1:{server.start()}"


def request() -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="hi"))


def serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    return bool(status == health_pb2.HealthCheckResponse.SERVING)


def test_health_and_refusals_answer_at_once_while_every_worker_holds_a_stream(tmp_path: Path) -> None:
    servicer = Held()
    socket = f"unix:{tmp_path}/health.sock"
    server = Server("127.0.0.1:0", max_workers=4, name="test", health_listen=socket)
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, DECODE)
    addr = f"127.0.0.1:{server.start()}"
    channel = grpc.insecure_channel(addr)
    stub, health = decode_pb2_grpc.DecodeStub(channel), health_pb2_grpc.HealthStub(channel)
    held = [stub.Generate(request(), timeout=30) for _ in range(4)]
    try:
        for call in held:
            next(call)  # each holds a worker now
        # More callers than the reserved workers, at once: each is refused, none waits for a stream to end.
        extra = 4 * RESERVED_WORKERS

        def refused(_: int) -> grpc.RpcError:
            call = stub.Generate(request(), timeout=10)  # the held streams hold 30 s: queued, this would expire
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            return info.value

        with ThreadPoolExecutor(extra) as pool:
            answers = list(pool.map(refused, range(extra)))
        for exc in answers:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert "limit of 4 calls at once" in exc.details() and "--max-workers" in exc.details()
            assert retry_after_s(exc) == pytest.approx(0.25)
        for _ in range(20):
            status = health.Check(health_pb2.HealthCheckRequest(service=DECODE), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        # The health socket (--health-listen) answers too, to gRPC and to the probes' command, in plaintext.
        assert serving(socket)
        probe = subprocess.run([KVSERVE, "health", socket], capture_output=True, text=True, timeout=60)
        assert (probe.returncode, probe.stdout.strip()) == (0, f"{socket}: SERVING"), probe.stderr
        servicer.release.set()
        for call in held:
            assert list(call)[-1].result.finish_reason == "length"
        # Every slot is back: as many streams as the limit are served again.
        again = [stub.Generate(request(), timeout=30) for _ in range(4)]
        assert [list(c)[-1].result.finish_reason for c in again] == ["length"] * 4
        server.drain()  # stopping: both say so
        assert not serving(addr) and not serving(socket)
    finally:
        servicer.release.set()
        channel.close()
        server.stop(0)


def test_a_cancelled_stream_gives_its_slot_back() -> None:
    servicer = Held()
    server, addr = serve(servicer, max_workers=1)
    try:
        with grpc.insecure_channel(addr) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            for _ in range(3):  # the one slot, taken and given back by cancelling, three times
                call = stub.Generate(request(), timeout=30)
                next(call)
                call.cancel()
                deadline = time.monotonic() + 5
                while server.limit.active and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert server.limit.active == 0
    finally:
        servicer.release.set()
        server.stop(0)


def test_a_call_refused_as_it_arrives_is_answered_without_its_request_being_read() -> None:
    """Past the call limit, or refused by an on-arrival check (decode's admission bound), a call is answered as it
    arrives: bytes that are no request message get RESOURCE_EXHAUSTED, not INVALID_ARGUMENT, and the servicer
    never sees the call."""
    servicer = Held()
    server, addr = serve(servicer, max_workers=1)
    admission = Admission("test", max_seqs=1, max_tokens=100)
    counted: list[BaseException] = []
    server.check_on_arrival(f"/{DECODE}/Generate", admission.refusal, counted.append)
    try:
        with grpc.insecure_channel(addr) as channel:
            raw = channel.unary_stream(f"/{DECODE}/Generate")  # bytes as they are, no serializer

            def answer() -> grpc.RpcError:
                with pytest.raises(grpc.RpcError) as info:
                    next(raw(b"\xff\xff not a GenerateRequest", timeout=10))
                return info.value

            assert answer().code() == grpc.StatusCode.INVALID_ARGUMENT  # with room, the request is read
            ticket = admission.admit(10)  # one request waits: the bound of one is reached
            refused = answer()
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert "--max-waiting-seqs" in refused.details() and retry_after_s(refused) == pytest.approx(0.1)
            ticket.release()
            held = decode_pb2_grpc.DecodeStub(channel).Generate(request(), timeout=30)
            next(held)  # the one call the limit allows
            refused = answer()
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
            assert "--max-workers" in refused.details() and retry_after_s(refused) == pytest.approx(0.25)
            assert servicer.calls == 1 and len(counted) == 1  # the check's refusal, not the limit's
            servicer.release.set()
            assert list(held)[-1].result.finish_reason == "length"
    finally:
        servicer.release.set()
        server.stop(0)


def silent_calls(channel: grpc.Channel, method: str, n: int, never: threading.Event) -> list[Any]:
    """`n` calls of `method` that never send their request (the request stream left open, nothing in it)."""

    def silent() -> Iterator[bytes]:
        never.wait()
        yield b""

    raw = channel.stream_stream(method)
    return [raw(silent(), timeout=30) for _ in range(n)]


def codes_of(calls: list[Any]) -> list[grpc.StatusCode]:
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        codes.append(info.value.code())  # type: ignore[attr-defined]
    return codes


def test_calls_that_never_send_their_request_count_against_the_limit_and_end_after_the_bound() -> None:
    """A caller that opens calls and never sends the request: each counts against the call limit from its start
    (the rest are refused at once), health and the refusals still answer, and each is cancelled once
    `request_wait_s` has passed, its slot back."""
    servicer = Held()
    server = Server("127.0.0.1:0", max_workers=4, name="test", request_wait_s=1.0)
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, DECODE)
    addr = f"127.0.0.1:{server.start()}"
    never = threading.Event()
    try:
        with grpc.insecure_channel(addr) as channel:
            calls = silent_calls(channel, f"/{DECODE}/Generate", 40, never)
            stub = decode_pb2_grpc.DecodeStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                next(stub.Generate(request(), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert serving(addr) and server.limit.active == 4
            codes = codes_of(calls)
            assert set(codes) == {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            assert codes.count(grpc.StatusCode.CANCELLED) == 4, codes
            servicer.release.set()
            assert list(stub.Generate(request(), timeout=10))[-1].result.finish_reason == "length"
            assert servicer.calls == 1
    finally:
        never.set()
        servicer.release.set()
        server.stop(0)


def test_health_checks_that_never_send_their_request_hold_a_few_workers_for_the_bound_at_most(tmp_path: Path) -> None:
    """Health checks count against PROBE_LIMIT, on the port and on --health-listen: a caller that opens them and
    never sends the request holds that many for `request_wait_s` at most, the rest are refused at once (which
    `kvserve health`, the probes' command, takes as BUSY: the server runs), and the workers that serve calls and
    refusals stay free."""
    servicer = Held()
    socket = f"unix:{tmp_path}/health.sock"
    server = Server("127.0.0.1:0", max_workers=4, name="test", health_listen=socket, request_wait_s=5.0)
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, DECODE)
    addr = f"127.0.0.1:{server.start()}"
    never = threading.Event()
    try:
        with grpc.insecure_channel(addr) as channel, grpc.insecure_channel(socket) as own:
            calls = [*silent_calls(channel, HEALTH_CHECK, 20, never), *silent_calls(own, HEALTH_CHECK, 20, never)]
            time.sleep(0.2)  # each has reached its server
            with pytest.raises(grpc.RpcError) as info:  # every probe slot is held: a probe is refused at once
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert "probes at once" in info.value.details()  # type: ignore[attr-defined]
            probe = subprocess.run([KVSERVE, "health", socket], capture_output=True, text=True, timeout=60)
            assert (probe.returncode, probe.stdout.strip()) == (0, f"{socket}: BUSY"), probe  # busy is not down
            stub = decode_pb2_grpc.DecodeStub(channel)
            held = stub.Generate(request(), timeout=30)
            next(held)  # a call is served meanwhile
            codes = codes_of(calls)
            assert codes.count(grpc.StatusCode.CANCELLED) == 2 * PROBE_LIMIT, codes  # ended after the bound
            assert set(codes) == {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            assert serving(addr) and serving(socket)
            servicer.release.set()
            assert list(held)[-1].result.finish_reason == "length"
    finally:
        never.set()
        servicer.release.set()
        server.stop(0)


def test_streams_open_to_every_caller_take_none_of_the_services_slots() -> None:
    """Health's Watch and reflection need no token and may last as long as their caller likes: they count against
    a limit of their own (PROBE_LIMIT), so a caller holding many takes no slot of --max-workers."""
    servicer = Held()
    server, addr = serve(servicer, max_workers=2)
    try:
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(PROBE_LIMIT)]
            for watch in watches:
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING  # each holds a worker now
            with pytest.raises(grpc.RpcError) as info:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert "health watches and reflection streams" in info.value.details()  # type: ignore[attr-defined]
            stub = decode_pb2_grpc.DecodeStub(channel)
            held = [stub.Generate(request(), timeout=30) for _ in range(2)]  # the service's two slots, both free
            for call in held:
                next(call)
            assert serving(addr)
            servicer.release.set()
            assert [list(call)[-1].result.finish_reason for call in held] == ["length"] * 2
            for watch in watches:
                watch.cancel()
    finally:
        servicer.release.set()
        server.stop(0)


def test_a_request_stream_silent_for_longer_than_the_bound_is_cancelled_and_a_slow_one_is_not() -> None:
    """A stream-request method (the store's Put): each message must come within `request_wait_s` of the one
    before. A stream that goes silent ends after the bound; one whose messages come more slowly than a stream
    would, but each within it, completes, however long it takes in all."""
    sink = grpc.stream_unary_rpc_method_handler(lambda requests, context: b"%d" % sum(len(r) for r in requests))
    server = Server("127.0.0.1:0", max_workers=4, name="test", request_wait_s=1.0)
    server.add(lambda _, s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Sink", {
        "Put": sink}),)), None, "test.Sink")
    addr = f"127.0.0.1:{server.start()}"
    never = threading.Event()

    def messages(gap_s: float, n: int, then_silent: bool) -> Iterator[bytes]:
        for _ in range(n):
            yield b"x"
            time.sleep(gap_s)
        if then_silent:
            never.wait()

    try:
        with grpc.insecure_channel(addr) as channel:
            put = channel.stream_unary("/test.Sink/Put")
            t = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                put(messages(0.0, 2, then_silent=True), timeout=30)
            assert info.value.code() == grpc.StatusCode.CANCELLED, info.value  # type: ignore[attr-defined]
            assert time.monotonic() - t < 10
            deadline = time.monotonic() + 5
            while server.limit.active and time.monotonic() < deadline:  # its worker lets go of the slot
                time.sleep(0.01)
            assert server.limit.active == 0
            assert put(messages(0.4, 5, then_silent=False), timeout=30) == b"5"  # 2 s in all, 0.4 s apart
    finally:
        never.set()
        server.stop(0)


def test_a_refusal_on_arrival_is_counted_only_for_callers_that_authentication_lets_in(tmp_path: Path) -> None:
    """Authentication answers first: a caller without a token gets UNAUTHENTICATED, not the busy refusal, and
    is not counted as refused. Unary and streaming methods alike are refused as they arrive."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"acme {hashlib.sha256(b'a-token').hexdigest()}\n")
    auth = Auth(Authenticator(tokens_file), TenantSalts(b"k" * 32))
    server = Server("127.0.0.1:0", max_workers=4, interceptors=auth.interceptors())
    served: list[bytes] = []

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        served.append(request)
        return request

    def echo_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        served.append(request)
        yield request

    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoStream": grpc.unary_stream_rpc_method_handler(echo_stream),
    })
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None, "test.Echo")
    admission = Admission("test", max_seqs=1, max_tokens=100)
    counted: list[BaseException] = []
    for method in ("Echo", "EchoStream"):
        server.check_on_arrival(f"/test.Echo/{method}", admission.refusal, counted.append)
    addr = f"127.0.0.1:{server.start()}"
    ticket = admission.admit(10)
    try:
        with grpc.insecure_channel(addr) as channel:
            calls = {"Echo": lambda md: channel.unary_unary("/test.Echo/Echo")(b"hi", metadata=md, timeout=10),
                     "EchoStream": lambda md: list(channel.unary_stream("/test.Echo/EchoStream")(
                         b"hi", metadata=md, timeout=10))}
            for method, call in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    call(())
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, info.value)
                assert not counted
            for method, call in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    call((("authorization", "Bearer a-token"),))
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, info.value)
                assert retry_after_s(info.value) == pytest.approx(0.1)
            assert len(counted) == 2 and not served
            ticket.release()
            assert calls["Echo"]((("authorization", "Bearer a-token"),)) == b"hi"
            assert calls["EchoStream"]((("authorization", "Bearer a-token"),)) == [b"hi"]
    finally:
        server.stop(0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_admission_bounds_waiting_sequences_and_tokens() -> None:
    admission = Admission("decode", max_seqs=2, max_tokens=100)
    big = admission.admit(500)  # alone, anything fits: it waits for nobody
    with pytest.raises(ResourceExhausted, match="prompt tokens wait.*--max-waiting-tokens"):
        admission.admit(1)
    big.release()
    a, b = admission.admit(40), admission.admit(40)
    with pytest.raises(ResourceExhausted, match="2 requests wait.*--max-waiting-seqs") as info:
        admission.admit(1)
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    a.computed()
    a.release()  # after computed: nothing more
    with pytest.raises(ResourceExhausted, match="--max-waiting-tokens"):
        admission.admit(61)  # 40 + 61 > 100
    c = admission.admit(60)
    assert "--max-waiting-seqs" in str(admission.refusal())  # any request arriving now would be refused
    b.release()
    assert admission.refusal() is None
    c.release()
    assert (admission.seqs, admission.tokens) == (0, 0)


def test_a_deadline_the_queue_cannot_meet_is_refused_at_the_measured_rate() -> None:
    clock = Clock()
    admission = Admission("prefill", max_seqs=100, max_tokens=10**6, clock=clock)
    assert admission.admit(1000, time_left_s=0.001)  # no rate measured yet: nothing to judge by
    first = admission.admit(1000)
    clock.now = 1.0
    first.computed()  # 1000 tokens in 1 busy second
    assert admission.rate == pytest.approx(1000)
    # 1000 tokens still wait ahead (the first ticket): 1 s at 1000 tokens/s.
    with pytest.raises(ResourceExhausted, match="take about 1.0 s.*deadline") as info:
        admission.admit(10, time_left_s=0.5)
    assert info.value.retry_after_s == pytest.approx(1.0)
    admission.admit(10, time_left_s=2.0).release()
    admission.admit(10).release()  # no deadline: the bounds alone


def test_the_client_retries_a_busy_refusal_after_its_hint() -> None:
    servicer = Held(refuse=2, hint_s=0.05)
    servicer.release.set()
    server, addr = serve(servicer, max_workers=4)
    try:
        with Client(addr, timeout_s=10, token="", tls_ca=None) as c:
            t = time.perf_counter()
            assert c.generate("hi").finish_reason == "length"
            assert time.perf_counter() - t >= 0.1  # it waited at least the hint (0.05 s) twice
        assert servicer.calls == 3
    finally:
        server.stop(0)


@pytest.mark.parametrize("hint_s", [None, 60.0])
def test_the_client_does_not_retry_without_a_hint_or_past_its_deadline(hint_s: float | None) -> None:
    servicer = Held(refuse=10, hint_s=hint_s)
    server, addr = serve(servicer, max_workers=4)
    try:
        with Client(addr, timeout_s=5, token="", tls_ca=None) as c, \
                pytest.raises(ResourceExhaustedError, match="busy"):
            c.generate("hi")
        assert servicer.calls == 1  # no hint, or a hint past the deadline: not sent again
    finally:
        server.stop(0)


def test_the_retry_hint_is_the_trailer_a_client_reads() -> None:
    servicer = Held(refuse=1, hint_s=1.5)
    server, addr = serve(servicer, max_workers=1)
    try:
        with grpc.insecure_channel(addr) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Generate(request(), timeout=5)
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            assert (RETRY_AFTER, "1500") in info.value.trailing_metadata()
            assert retry_after_s(info.value) == 1.5
    finally:
        server.stop(0)
