"""Decode computes a prompt itself when prefill cannot: overloaded (RESOURCE_EXHAUSTED), failing (INTERNAL,
UNKNOWN) or not answering within decode's cap on it; each counted by reason. A status about the request
itself, and anything once the caller's deadline has passed, goes to the caller. Prefill here is a fake
servicer in a real gRPC server on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from client import Client
from client.client import InvalidArgumentError, OutOfRangeError
from decode_service.cancellation import Cancellation
from decode_service.service import GenerateJob
from kvserve.engine.sampling import SamplingParams
from kvserve.handoff.requests import PromptInput, RequestOptions
from kvserve.rpc.errors import Unavailable
from prefill_service.client import PrefillClient, UpstreamError
from protos.kvserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.polling import wait_until
from tests.stack_fixtures import BLOCK_SIZE, LocalStack, assert_greedy_matches, oracle, tokens

ARCH = "llama"
CAP_S = 1.0  # decode's --prefill-timeout-s


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """Answers every call with ``status`` (None: no answer until the caller goes away)."""

    def __init__(self) -> None:
        self.status: grpc.StatusCode | None = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.calls = 0
        self.time_left: list[float | None] = []  # each call's deadline as it arrived

    def PrefillStream(self, request: prefill_pb2.PrefillRequest,  # noqa: N802 - gRPC method name
                      context: grpc.ServicerContext) -> Iterator[prefill_pb2.PrefillResponse]:
        self.calls += 1
        self.time_left.append(context.time_remaining())
        if self.status is None:
            gone = threading.Event()
            context.add_callback(gone.set)
            gone.wait(30)
            return
        context.abort(self.status, f"fake prefill: {self.status.name}")
        yield from ()


@pytest.fixture(scope="module")
def prefill() -> Iterator[tuple[str, FakePrefill]]:
    servicer = FakePrefill()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0).wait()


@pytest.fixture(scope="module")
def stack(prefill: tuple[str, FakePrefill]) -> Iterator[LocalStack]:
    addr, _ = prefill
    with LocalStack(ARCH, wrap_prefill_client=lambda _: PrefillClient(addr, timeout_s=CAP_S)) as s:
        yield s


def fallbacks(stack: LocalStack) -> dict[str, float | None]:
    get = stack.decode_server.registry.get_sample_value
    return {r: get("kvserve_decode_prefill_fallbacks_total", {"reason": r})
            for r in ("unavailable", "overloaded", "failed")}


def settled(stack: LocalStack) -> None:
    """Waits until decode has no request left in hand."""
    wait_until(lambda: stack.decode_metric("kvserve_decode_waiting_requests") == 0
               and stack.decode_metric("kvserve_decode_running_requests") == 0)


@pytest.mark.parametrize(("status", "reason"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
    (grpc.StatusCode.INTERNAL, "failed"),
    (grpc.StatusCode.UNKNOWN, "failed"),
    (None, "failed"),  # no answer within decode's cap
])
def test_a_prefill_that_cannot_leaves_decode_to_compute_the_prompt(
    stack: LocalStack, prefill: tuple[str, FakePrefill], caplog: pytest.LogCaptureFixture,
    status: grpc.StatusCode | None, reason: str,
) -> None:
    _, servicer = prefill
    servicer.status = status
    ids = tokens(3 * BLOCK_SIZE + 5, seed=91)
    want, logits = oracle(ARCH, ids, 12)
    before = fallbacks(stack)
    assert None not in before.values()  # every reason on the page from the start
    calls = servicer.calls
    with Client(stack.addr, timeout_s=60) as c:
        r = c.generate(token_ids=ids, max_tokens=12, ignore_eos=True)
    assert_greedy_matches(r.token_ids, want, logits)
    assert r.timings.prefill_path == "local" and servicer.calls == calls + 1  # asked once, not again
    after = fallbacks(stack)
    assert {k: after[k] - before[k] for k in after} == {  # type: ignore[operator]
        k: float(k == reason) for k in after}
    assert f"prefill {reason} for " in caplog.text and "computing its prompt here" in caplog.text


def test_a_status_about_the_request_goes_to_the_caller(stack: LocalStack, prefill: tuple[str, FakePrefill]) -> None:
    _, servicer = prefill
    before = fallbacks(stack)
    for status, error in ((grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
                          (grpc.StatusCode.OUT_OF_RANGE, OutOfRangeError)):
        servicer.status = status
        with Client(stack.addr, timeout_s=30) as c, pytest.raises(error, match=f"fake prefill: {status.name}"):
            c.generate(token_ids=tokens(20, seed=92), max_tokens=4)
    settled(stack)
    assert fallbacks(stack) == before


def test_nothing_falls_back_once_the_callers_deadline_has_passed(
    stack: LocalStack, prefill: tuple[str, FakePrefill]
) -> None:
    _, servicer = prefill
    servicer.status = grpc.StatusCode.INTERNAL
    before = fallbacks(stack)
    local = stack.decode_metric("kvserve_decode_prefills_total", path="local")
    job = GenerateJob("late", PromptInput(token_ids=tuple(tokens(20, seed=93))), RequestOptions(SamplingParams()),
                      arrival=time.perf_counter() - 10, time_left_s=5.0)  # the caller gave up 5 s ago
    with pytest.raises(UpstreamError, match="fake prefill: INTERNAL|the caller's deadline"):  # none of it was left
        list(stack.decode.generate(job, Cancellation()))
    assert fallbacks(stack) == before
    assert stack.decode_metric("kvserve_decode_prefills_total", path="local") == local


@pytest.mark.parametrize(("cap_s", "caller_s", "want_s"), [(None, None, None), (None, 600.0, 600.0),
                                                          (5.0, 600.0, 5.0), (5.0, None, 5.0), (600.0, 5.0, 5.0)])
def test_the_prefill_call_has_the_callers_deadline_and_a_cap_only_when_given(
        prefill: tuple[str, FakePrefill], cap_s: float | None, caller_s: float | None, want_s: float | None) -> None:
    """A request queued behind others fails at its caller's deadline, never at a timer of decode's own:
    without --prefill-timeout-s the call to prefill has exactly the caller's deadline (none: none)."""
    addr, servicer = prefill
    servicer.status, servicer.time_left = grpc.StatusCode.RESOURCE_EXHAUSTED, []
    client = PrefillClient(addr, timeout_s=cap_s)
    try:
        call = client.start("r", PromptInput(token_ids=(1, 2, 3)), RequestOptions(SamplingParams()),
                            time_left_s=caller_s)
        with pytest.raises(UpstreamError):
            call.first()
        assert call.capped == (cap_s is not None and (caller_s is None or cap_s < caller_s))
    finally:
        client.close()
    [got] = servicer.time_left
    if want_s is None:
        assert got is None or got > 10**9  # gRPC's "no deadline"
    else:
        assert got is not None and abs(got - want_s) < 5  # less the time the call took to arrive


def test_the_prefill_call_gets_what_is_left_of_the_callers_deadline(
        stack: LocalStack, prefill: tuple[str, FakePrefill]) -> None:
    """What went on in decode before the call (reading the prompt, waiting to be admitted, a replica that failed)
    comes off the deadline prefill is given: 0.5 s left of the caller's 10, under decode's cap of 1 s."""
    _, servicer = prefill
    servicer.status, servicer.time_left = grpc.StatusCode.RESOURCE_EXHAUSTED, []
    job = GenerateJob("spent", PromptInput(token_ids=tuple(tokens(20, seed=94))), RequestOptions(SamplingParams()),
                      arrival=time.perf_counter() - 9.5, time_left_s=10.0)
    list(stack.decode.generate(job, Cancellation()))
    [got] = servicer.time_left
    assert got is not None and got < 0.6


def test_a_decode_that_stops_while_prefill_computes_says_unavailable(prefill: tuple[str, FakePrefill]) -> None:
    """Stopping closes decode's channels to prefill, which ends its calls CANCELLED: the request then fails
    UNAVAILABLE (a router asks another replica), not as if its caller had left (an empty stream, status OK)."""
    addr, servicer = prefill
    servicer.status = None  # prefill answers nothing until its caller goes away
    stack = LocalStack(ARCH, wrap_prefill_client=lambda _: PrefillClient(addr, timeout_s=60))
    try:
        job = GenerateJob("cut", PromptInput(token_ids=tuple(tokens(20, seed=95))), RequestOptions(SamplingParams()),
                          arrival=time.perf_counter(), time_left_s=60.0)
        calls, outcome = servicer.calls, []

        def run() -> None:
            try:
                outcome.append(list(stack.decode.generate(job, Cancellation())))
            except Exception as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: servicer.calls > calls)
        stack.decode.stop()
        thread.join(30)
        [got] = outcome
        assert isinstance(got, Unavailable) and "shutting down" in str(got), got
    finally:
        stack.close()
