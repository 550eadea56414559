"""The router under load and under failure (issue 27): busy is not dead, a request every replica refuses as
busy ends RESOURCE_EXHAUSTED with retry-after-ms (never UNAVAILABLE) within its deadline, and a stream whose
replica dies goes on from another replica, resumed after the tokens the caller has.

Replicas are tests/fake_decode.py's, over real gRPC in this process (one in a process of its own, killed)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from kvserve.router.replica import DECODE_SERVICE
from kvserve.router.router import Router
from kvserve.router.server import RouterMetrics, RouterServicer
from kvserve.rpc.server import Server
from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.fake_decode import FakeReplica, FakeServer, positional
from tests.polling import wait_until

Code = grpc.StatusCode
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TOKEN = [("authorization", "Bearer tenant-a")]


@dataclass
class Routed:
    router: Router
    registry: CollectorRegistry
    addr: str

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextmanager
def routed(addrs: Sequence[str], *, start: bool = True, policy: str = "least-loaded", **kwargs: Any) -> Iterator[Routed]:
    """A router in front of `addrs`, serving on loopback. `start`: it watches their health (every 50 ms, a
    check unanswered after 0.2 s); without, the test says which replicas are healthy."""
    router = Router(addrs, policy=policy, poll_s=0.05, check_timeout_s=0.2, **kwargs)
    registry = CollectorRegistry()
    router.on_route = RouterMetrics(registry, router).observe
    server = Server("127.0.0.1:0", registry=registry)
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, RouterServicer(router), DECODE_SERVICE)
    port = server.start()
    if start:
        router.start()
    try:
        yield Routed(router, registry, f"127.0.0.1:{port}")
    finally:
        server.stop(0)
        router.close()


@contextmanager
def fakes(n: int, **kwargs: Any) -> Iterator[list[FakeServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(FakeServer(replica=FakeReplica(), **kwargs)) for _ in range(n)]


@dataclass
class Answer:
    tokens: list[int]
    result: decode_pb2.GenerateResult | None
    code: grpc.StatusCode
    details: str
    trailers: dict[str, str]
    seconds: float


def generate(addr: str, request: decode_pb2.GenerateRequest, timeout_s: float = 10.0) -> Answer:
    """The whole answer a caller of the router gets, as it came."""
    t0 = time.monotonic()
    with grpc.insecure_channel(addr) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=timeout_s, metadata=TOKEN)
        tokens, result = [], None
        try:
            for response in call:
                if response.WhichOneof("kind") == "token":
                    tokens.append(response.token.token_id)
                else:
                    result = response.result
        except grpc.RpcError:
            pass
        return Answer(tokens, result, call.code(), call.details() or "", dict(call.trailing_metadata() or ()),
                      time.monotonic() - t0)


def request(max_tokens: int = 4, seed: int = 7) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id="req-1", prompt=common_pb2.Prompt(text="the quick brown fox"),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed),
        cache=common_pb2.CacheOptions(cache_salt="s"))


def uninterrupted(req: decode_pb2.GenerateRequest) -> list[int]:
    return [positional(req, i) for i in range(req.sampling.max_tokens)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- busy is not dead ------------------------------------------------------------------------------


def test_a_replica_whose_health_times_out_keeps_its_place_until_it_is_taken_as_dead(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvserve.router")
    with fakes(1) as (busy,), routed([busy.addr], dead_after_s=2.0) as r:
        wait_until(lambda: r.router.num_healthy == 1, message="the replica was never healthy")
        busy.health.hung.set()  # its workers all taken: checks go unanswered
        checks = busy.health.checks
        wait_until(lambda: busy.health.checks >= checks + 3, message="no more health checks")  # 2 timed out
        assert r.router.num_healthy == 1
        answer = generate(r.addr, request())
        assert answer.code == Code.OK and len(answer.tokens) == 4 and len(busy.servicer.requests) == 1

        # Unanswered for dead_after_s: hung or stopped. Said once, and requests fail as before.
        wait_until(lambda: r.router.num_healthy == 0, timeout_s=5, message="never taken as dead")
        time.sleep(0.3)  # more checks go unanswered
        dead = [m for m in caplog.messages if "answered no health check" in m]
        assert len(dead) == 1 and busy.addr in dead[0]
        answer = generate(r.addr, request())
        assert answer.code == Code.UNAVAILABLE and "no healthy decode replica" in answer.details

        busy.health.hung.clear()  # it answers again: back
        wait_until(lambda: r.router.num_healthy == 1, message="never healthy again")


def test_a_replica_that_refuses_its_health_checks_as_busy_keeps_its_place() -> None:
    """A replica answers only a few health checks at once (rpc.server.PROBE_LIMIT): callers holding those make it
    refuse the router's as busy. It answers, so it is alive: it keeps its place however long that lasts."""
    with fakes(1) as (busy,), routed([busy.addr], dead_after_s=0.5) as r:
        wait_until(lambda: r.router.num_healthy == 1, message="the replica was never healthy")
        busy.health.refusing.set()
        checks = busy.health.checks
        wait_until(lambda: busy.health.checks >= checks + 20, message="no more health checks")  # 1 s of refusals
        assert r.router.num_healthy == 1
        answer = generate(r.addr, request())
        assert answer.code == Code.OK and len(answer.tokens) == 4 and len(busy.servicer.requests) == 1


def test_a_replica_that_says_not_serving_is_skipped() -> None:
    with fakes(2) as (draining, serving), routed([draining.addr, serving.addr]) as r:
        draining.health.set(DECODE_SERVICE, NOT_SERVING)
        wait_until(lambda: r.router.num_healthy == 1 and r.router.replicas[serving.addr].healthy,
                   message="the draining replica was not skipped")
        for _ in range(4):
            assert generate(r.addr, request()).code == Code.OK
        assert (len(draining.servicer.requests), len(serving.servicer.requests)) == (0, 4)

        serving.health.set(DECODE_SERVICE, NOT_SERVING)  # none serves: that is UNAVAILABLE, as before
        wait_until(lambda: r.router.num_healthy == 0, message="the replica never went out")
        answer = generate(r.addr, request())
        assert answer.code == Code.UNAVAILABLE and "no healthy decode replica" in answer.details


def test_a_refused_connection_is_skipped() -> None:
    gone = f"127.0.0.1:{closed_port()}"
    with fakes(1) as (up,):
        with routed([gone, up.addr]) as r:  # by its health check
            wait_until(lambda: r.router.replicas[up.addr].healthy, message="the replica was never healthy")
            time.sleep(0.2)
            assert not r.router.replicas[gone].healthy
            assert generate(r.addr, request()).code == Code.OK
        with routed([gone, up.addr], start=False) as r:  # by a call, before any health check has said so
            for replica in r.router.replicas.values():
                replica.healthy = True
            r.router.replicas[up.addr].others_load = 1  # least loaded: the one that is gone goes first
            answer = generate(r.addr, request())
            assert answer.code == Code.OK and len(answer.tokens) == 4
            assert not r.router.replicas[gone].healthy
        assert len(up.servicer.requests) == 2


# --- all busy -----------------------------------------------------------------------------------------


def test_when_every_replica_is_busy_the_caller_is_told_when_to_retry() -> None:
    with fakes(2) as replicas, routed([f.addr for f in replicas]) as r:
        wait_until(lambda: r.router.num_healthy == 2, message="the replicas were never healthy")
        for f in replicas:
            f.servicer.refuse, f.servicer.retry_after_ms = Code.RESOURCE_EXHAUSTED, 100
        answer = generate(r.addr, request(), timeout_s=10)
        assert answer.code == Code.RESOURCE_EXHAUSTED
        assert answer.trailers.get("retry-after-ms") == "100"
        assert "busy: 80 sequences waiting" in answer.details and "asked 3 times" in answer.details
        assert answer.seconds < 1.5  # two waits of 100-200 ms between three rounds, not the 10 s deadline
        assert [len(f.servicer.requests) for f in replicas] == [3, 3]
        assert r.router.num_healthy == 2  # busy, not dead
        assert r.metric("kvserve_router_overloaded_total") == 1
        assert all(r.metric("kvserve_router_refused_total", replica=f.addr) == 3 for f in replicas)


def test_a_refusal_without_a_hint_is_not_asked_again() -> None:
    """No retry-after-ms: the request will not fit there (protos.retry); the caller gets it at once, with no hint."""
    with fakes(2) as replicas, routed([f.addr for f in replicas]) as r:
        wait_until(lambda: r.router.num_healthy == 2, message="the replicas were never healthy")
        for f in replicas:
            f.servicer.refuse = Code.RESOURCE_EXHAUSTED
        answer = generate(r.addr, request())
        assert answer.code == Code.RESOURCE_EXHAUSTED and "retry-after-ms" not in answer.trailers
        assert [len(f.servicer.requests) for f in replicas] == [1, 1]
        assert r.metric("kvserve_router_overloaded_total") == 0


def test_one_busy_and_one_free_the_free_one_serves_at_once() -> None:
    with fakes(2) as (busy, free), routed([busy.addr, free.addr], start=False, policy="round-robin") as r:
        for replica in r.router.replicas.values():
            replica.healthy = True
        busy.servicer.refuse, busy.servicer.retry_after_ms = Code.RESOURCE_EXHAUSTED, 1000
        answers = [generate(r.addr, request()) for _ in range(4)]
        assert all(a.code == Code.OK and len(a.tokens) == 4 for a in answers)
        assert sum(a.seconds for a in answers) < 1.0  # no backoff: the next replica is asked at once
        assert len(free.servicer.requests) == 4 and len(busy.servicer.requests) >= 2  # asked first, in turn
        assert r.metric("kvserve_router_overloaded_total") == 0


def test_busy_replicas_refusing_a_prompts_hashes_place_it_by_load() -> None:
    """Under --policy prefix the router first asks a replica for the prompt's hashes; a busy one refuses that
    call too (its calls at their limit), which is no answer for the caller: the request is placed by load."""
    with fakes(2) as replicas, routed([f.addr for f in replicas], policy="prefix") as r:
        wait_until(lambda: r.router.num_healthy == 2, message="the replicas were never healthy")
        for f in replicas:
            assert f.replica is not None
            f.replica.refuse = Code.RESOURCE_EXHAUSTED
        answer = generate(r.addr, request())
        assert answer.code == Code.OK and len(answer.tokens) == 4
        assert sum(len(f.replica.prefix_metadata) for f in replicas if f.replica) == 2  # both asked


def test_the_callers_deadline_bounds_the_retries() -> None:
    with fakes(2) as replicas, routed([f.addr for f in replicas]) as r:
        wait_until(lambda: r.router.num_healthy == 2, message="the replicas were never healthy")
        for f in replicas:
            f.servicer.refuse, f.servicer.retry_after_ms = Code.RESOURCE_EXHAUSTED, 1500
        answer = generate(r.addr, request(), timeout_s=1.0)  # less than the wait they ask for
        assert answer.code == Code.RESOURCE_EXHAUSTED and answer.trailers.get("retry-after-ms") == "1500"
        assert answer.seconds < 0.5
        assert [len(f.servicer.requests) for f in replicas] == [1, 1]


# --- a stream whose replica died ----------------------------------------------------------------------


def test_a_stream_whose_replica_dies_goes_on_from_another() -> None:
    req = request(max_tokens=10)
    with fakes(2, tokens=positional, delay_s=0.02) as (dying, other), \
            routed([dying.addr, other.addr], start=False) as r:
        for replica in r.router.replicas.values():
            replica.healthy = True
        r.router.replicas[other.addr].others_load = 1  # the dying one goes first
        dying.servicer.die_after = 3
        answer = generate(r.addr, req, timeout_s=5)
        assert not r.router.replicas[dying.addr].healthy
        assert r.router.migrations() == {"resumed": 1}
        assert r.metric("kvserve_router_migrations_total", outcome="resumed") == 1
    want = uninterrupted(req)
    assert answer.code == Code.OK
    assert answer.tokens == want  # one stream, as if nothing had happened
    assert answer.result is not None and list(answer.result.token_ids) == want
    assert answer.result.text == "".join(map(chr, want)) and answer.result.usage.completion_tokens == 10

    (moved,) = other.servicer.requests
    assert list(moved.resume_token_ids) == want[:3]
    moved.ClearField("resume_token_ids")
    assert moved == req  # prompt, sampling and its seed, max_tokens, cache, request_id
    assert other.servicer.metadata[0]["authorization"] == "Bearer tenant-a"
    first_left, moved_left = dying.servicer.time_left[0], other.servicer.time_left[0]
    assert first_left is not None and moved_left is not None
    # What was left of the caller's deadline: at least 3 tokens' delay (0.06 s) less. gRPC sends a deadline
    # rounded up, to 10 ms under 10 s (100 ms above: at 10 s both calls arrived as 10.1 s).
    assert moved_left < first_left - 0.03 and first_left <= 5.01


def test_a_stream_moves_at_most_max_migrations_times() -> None:
    req = request(max_tokens=10)
    with fakes(3, tokens=positional) as replicas, routed([f.addr for f in replicas], start=False,
                                                         max_migrations=1) as r:
        for i, f in enumerate(replicas):
            r.router.replicas[f.addr].healthy = True
            r.router.replicas[f.addr].others_load = i  # in order
            f.servicer.die_after = 2
        answer = generate(r.addr, req)
        assert answer.code == Code.UNAVAILABLE and "--max-migrations" in answer.details
        assert answer.tokens == uninterrupted(req)[:4] and answer.result is None
        assert [len(f.servicer.requests) for f in replicas] == [1, 1, 0]
        assert r.router.migrations() == {"resumed": 1, "limit": 1}
        assert r.metric("kvserve_router_migrations_total", outcome="limit") == 1


def test_a_stream_with_no_replica_left_to_move_to_fails_unavailable() -> None:
    req = request(max_tokens=10)
    with fakes(1, tokens=positional) as (dying,), routed([dying.addr], start=False) as r:
        r.router.replicas[dying.addr].healthy = True
        dying.servicer.die_after = 2
        answer = generate(r.addr, req)
        assert answer.code == Code.UNAVAILABLE and answer.tokens == uninterrupted(req)[:2]
        assert r.router.migrations() == {"failed": 1}


CHILD = """
import sys, time
from tests.fake_decode import FakeReplica, FakeServer, positional
fake = FakeServer(delay_s=0.05, replica=FakeReplica(), tokens=positional).__enter__()
print(fake.addr, flush=True)
time.sleep(60)
"""


def test_a_stream_whose_replica_is_killed_goes_on_from_another() -> None:
    """A process killed mid-stream: its connection resets (UNAVAILABLE), and the stream goes on."""
    req = request(max_tokens=40)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert child.stdout is not None
        killed = child.stdout.readline().strip()
        with fakes(1, tokens=positional) as (other,), routed([killed, other.addr], start=False) as r:
            for replica in r.router.replicas.values():
                replica.healthy = True
            r.router.replicas[other.addr].others_load = 1
            with grpc.insecure_channel(r.addr) as channel:
                call = decode_pb2_grpc.DecodeStub(channel).Generate(req, timeout=10, metadata=TOKEN)
                tokens, result = [], None
                for response in call:
                    if response.WhichOneof("kind") == "token":
                        tokens.append(response.token.token_id)
                        if len(tokens) == 3:
                            os.kill(child.pid, signal.SIGKILL)
                    else:
                        result = response.result
            assert r.router.migrations() == {"resumed": 1}
        want = uninterrupted(req)
        assert tokens == want and result is not None and list(result.token_ids) == want
        (moved,) = other.servicer.requests
        k = len(moved.resume_token_ids)
        assert 3 <= k < 40 and list(moved.resume_token_ids) == want[:k]
    finally:
        child.kill()
        child.wait()
