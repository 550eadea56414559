"""A decode replica that takes Generate and never answers, while its health says SERVING (a security and fault
review: 5 of 10 requests through the router waited out their 60 s deadline on it, and the router kept sending it
every other request). Now an attempt with no first response within --first-token-timeout-s is cancelled and the
request goes to another replica; after --eject-after such failures in a row the replica is ejected for
--ejection-s, and taken back once that time is over and its health check says it serves.

The first test runs the router as a process of its own with those flags, in front of a working decode replica
(LocalStack: the tiny llama, answers checked against Hugging Face) and a hanging one, both real gRPC servers in
this process. The others run the router in this process in front of tests/fake_decode.py's replicas."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.client import build_request
from client.metrics import parse_metrics
from kvserve.bench.target import free_port
from kvserve.router.__main__ import parser
from kvserve.router.replica import DECODE_SERVICE, Replica
from kvserve.rpc.cli import env_args
from kvserve.stack.stack import Service, start_service, stop_service
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc
from tests.fake_decode import FakeDecode, FakeHealth, FakeReplica, positional
from tests.polling import wait_until
from tests.stack_fixtures import BLOCK_SIZE, LocalStack, assert_greedy_matches, oracle, stack_fixture, tokens
from tests.test_router_overload import Code, fakes, generate, request, routed

ARCH = "llama"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The router process's flags: a first token well above the tiny model's here (tens of ms; 2 s leaves room for
# 2 busy cores), an ejection that a test can wait out.
FIRST_TOKEN_S = 2.0
EJECT_AFTER = 3
EJECTION_S = 3.0
DEADLINE_S = 30.0  # each caller's, as the review's 60 s: what a request cost before
RETRY_S = 10.0  # slack for the retry: a whole answer of the working replica, 5 at once, on 2 shared cores
MAX_TOKENS = 8


class Hanging(FakeDecode):
    """While `hung` is set, takes each Generate and sends nothing until the call is cancelled (its engine loop
    stuck, its health still SERVING); then answers as FakeDecode does (positional tokens)."""

    def __init__(self) -> None:
        super().__init__(tokens=positional)
        self.hung = threading.Event()
        self.hung.set()

    def Generate(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateResponse]:
        if not self.hung.is_set():
            yield from super().Generate(request, context)
            return
        self.requests.append(request)
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        cancelled.wait()
        self._record("cancelled")


@contextmanager
def hanging() -> Iterator[tuple[str, Hanging, FakeHealth]]:
    """A real gRPC server on loopback: Hanging's Decode, FakeReplica's DecodeReplica, health SERVING."""
    servicer, health = Hanging(), FakeHealth()
    health.set(DECODE_SERVICE, SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    decode_pb2_grpc.add_DecodeReplicaServicer_to_server(FakeReplica(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer, health
    finally:
        server.stop(0).wait()


stack = stack_fixture(LocalStack, ARCH)


@contextmanager
def router_process(decode: Sequence[str], log_path: Path) -> Iterator[tuple[Service, int]]:
    """`kvserve router` in front of `decode`, round robin, with the test's first-token and ejection flags; its
    metrics port."""
    metrics_port = free_port()
    service = start_service("router", "kvserve.router", [
        "--listen", "127.0.0.1:0", "--decode", ",".join(decode), "--policy", "round-robin", "--insecure",
        "--metrics-port", str(metrics_port), "--first-token-timeout-s", str(FIRST_TOKEN_S),
        "--eject-after", str(EJECT_AFTER), "--ejection-s", str(EJECTION_S)], log_path=log_path)
    try:
        yield service, metrics_port
    finally:
        stop_service(service)


def reached(servicer: FakeDecode, n: int) -> Callable[[], bool]:
    return lambda: len(servicer.requests) >= n


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def test_a_replica_that_never_answers_costs_a_request_its_first_token_deadline_and_is_ejected(
        stack: LocalStack, tmp_path: Path) -> None:
    prompts = [tokens(BLOCK_SIZE + 3 * i, seed=500 + i) for i in range(20)]
    oracles = [oracle(ARCH, ids, MAX_TOKENS) for ids in prompts]
    requests = [build_request(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True) for ids in prompts]
    log_path = tmp_path / "router.log"
    with hanging() as (hung_addr, hung, _), router_process([hung_addr, stack.addr], log_path) as (router, port):
        wait_until(lambda: metrics(port).get("kvserve_router_healthy_replicas") == 2, timeout_s=30,
                   message="the router never saw both replicas healthy")
        timeouts = f'kvserve_router_first_token_timeouts_total{{replica="{hung_addr}"}}'
        ejections = f'kvserve_router_ejections_total{{replica="{hung_addr}"}}'

        # 10 callers at once, as in the review: round robin sends every other one to the hanging replica.
        start = time.monotonic()
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda r: generate(router.addr, r, timeout_s=DEADLINE_S), requests[:10]))
        assert [a.code for a in answers] == [Code.OK] * 10, [a.details for a in answers]
        for answer, (want, logits) in zip(answers, oracles[:10], strict=True):
            assert_greedy_matches(answer.tokens, want, logits)
            assert answer.result is not None and list(answer.result.token_ids) == answer.tokens
        worst = max(a.seconds for a in answers)
        assert worst < FIRST_TOKEN_S + RETRY_S  # before: the callers' whole deadline
        sent = len(hung.requests)
        assert sent >= EJECT_AFTER
        assert hung.wait_outcomes(sent) == ["cancelled"] * sent  # its calls cut, not left open to the deadline
        m = metrics(port)
        assert m[timeouts] == sent and m[ejections] == 1 and m["kvserve_router_ejected_replicas"] == 1

        # Ejected: 10 more callers, none sent there.
        with ThreadPoolExecutor(10) as pool:
            more = list(pool.map(lambda r: generate(router.addr, r, timeout_s=DEADLINE_S), requests[10:]))
        assert [a.code for a in more] == [Code.OK] * 10
        for answer, (want, logits) in zip(more, oracles[10:], strict=True):
            assert_greedy_matches(answer.tokens, want, logits)
        assert len(hung.requests) == sent and metrics(port)[timeouts] == sent

        # It answers again (its health said SERVING all along): taken back once its ejection time is over.
        hung.hung.clear()
        wait_until(lambda: metrics(port).get("kvserve_router_ejected_replicas") == 0, timeout_s=EJECTION_S + 10,
                   interval_s=0.1, message="the replica was never taken back")
        back_after = time.monotonic() - start
        assert back_after >= FIRST_TOKEN_S + EJECTION_S  # ejected at the first timeouts, for EJECTION_S
        again = [generate(router.addr, r, timeout_s=DEADLINE_S) for r in requests[:4]]
        assert all(a.code == Code.OK and len(a.tokens) == MAX_TOKENS for a in again)
        assert len(hung.requests) == sent + 2 and hung.wait_outcomes(sent + 2)[sent:] == ["ok", "ok"]
    log = log_path.read_text()
    ejected = [line for line in log.splitlines() if "ejected for" in line]
    assert len(ejected) == 1 and hung_addr in ejected[0] and f"ejected for {EJECTION_S:.0f} s" in ejected[0]
    assert f"decode replica {hung_addr} is back in choice" in log
    print(f"\n10 callers at once, every other one sent to a hanging replica: slowest answer {worst:.2f} s "
          f"(--first-token-timeout-s {FIRST_TOKEN_S:g}, deadline {DEADLINE_S:g} s); {sent} calls there cut, "
          f"ejected after {EJECT_AFTER}; taken back {back_after:.1f} s after the first request")


def test_a_caller_that_goes_away_is_not_the_replicas_failure() -> None:
    """The caller's cancel cancels the replica's call too (CANCELLED, as the router's own cut): it is told apart,
    so the replica counts no failure and the request goes nowhere else."""
    with hanging() as (hung_addr, hung, _), fakes(1) as (working,), \
            routed([hung_addr, working.addr], start=False, policy="round-robin", first_token_timeout_s=1.0,
                   eject_after=1) as r:
        for replica in r.router.replicas.values():
            replica.healthy = True
        r.router.replicas[working.addr].last_chosen = 1 << 30  # the hanging one goes first, every time
        with grpc.insecure_channel(r.addr) as channel:
            for i in range(3):
                call = decode_pb2_grpc.DecodeStub(channel).Generate(request(), timeout=10)
                wait_until(reached(hung, i + 1), message="the request never reached the replica")
                call.cancel()
                assert hung.wait_outcomes(i + 1)[i] == "cancelled"
        time.sleep(1.2)  # past --first-token-timeout-s: a watch left running would have fired by now
        assert r.router.first_token_timeouts() == {} and r.router.ejections() == {}
        assert r.router.num_ejected == 0 and working.servicer.requests == []


def test_a_first_token_with_nowhere_else_to_go_is_waited_for() -> None:
    """A slow first token (a long prompt on a busy replica) is cut only for another replica: where none is left,
    or the caller's deadline comes first, the replica keeps the request."""
    with fakes(1, delay_s=0.5, tokens=positional) as (slow,), \
            routed([slow.addr], first_token_timeout_s=0.2) as r:
        wait_until(lambda: r.router.num_healthy == 1, message="the replica was never healthy")
        answer = generate(r.addr, request())
        assert answer.code == Code.OK and answer.tokens == [positional(request(), i) for i in range(4)]
        assert r.router.first_token_timeouts() == {}
    with hanging() as (hung_addr, hung, _), fakes(1) as (working,), \
            routed([hung_addr, working.addr], start=False, policy="round-robin", first_token_timeout_s=1.0) as r:
        for replica in r.router.replicas.values():
            replica.healthy = True
        r.router.replicas[working.addr].last_chosen = 1 << 30
        answer = generate(r.addr, request(), timeout_s=0.5)  # its deadline before the first-token one
        assert answer.code == Code.DEADLINE_EXCEEDED and len(hung.requests) == 1
        assert working.servicer.requests == [] and r.router.first_token_timeouts() == {}


def test_the_last_replica_serving_is_never_ejected() -> None:
    """Two replicas failing every request (UNAVAILABLE at once, their health SERVING): the first to reach
    --eject-after is ejected, the other never, as the last one serving; it serves again as soon as it works."""
    with fakes(2) as (a, b), routed([a.addr, b.addr], policy="round-robin", eject_after=2, ejection_s=60) as r:
        wait_until(lambda: r.router.num_healthy == 2, message="the replicas were never healthy")
        a.servicer.refuse = b.servicer.refuse = Code.UNAVAILABLE
        for _ in range(4):
            answer = generate(r.addr, request())
            assert answer.code == Code.UNAVAILABLE and "no healthy decode replica" in answer.details
            wait_until(lambda: r.router.num_healthy == 2, message="the replicas were never healthy again")
        ((ejected, n),) = r.router.ejections().items()
        assert n == 1 and r.router.num_ejected == 1
        last = b if ejected == a.addr else a
        assert len(last.servicer.requests) >= 3  # it failed past --eject-after, and was kept
        last.servicer.refuse = None
        answer = generate(r.addr, request())
        assert answer.code == Code.OK and len(answer.tokens) == 4
        assert r.router.ejections() == {ejected: 1}


def test_each_ejection_lasts_longer_up_to_the_cap_and_ends_only_when_health_says_serving() -> None:
    """Ejection n lasts n × the base, at most the cap; each base served since the last takes one off. It ends
    when its time is over and a health check says SERVING, not before either."""
    now = [1000.0]
    with fakes(1) as (fake,):
        replica = Replica(fake.addr, None, [], 1000, poll_s=0.02, clock=lambda: now[0],
                          dead_after_s=1e9)  # the clock's jumps are not a silence
        replica.start()
        try:
            wait_until(lambda: replica.serving, message="the replica was never healthy")

            def ejected_for() -> float:
                seconds = replica.ejection.eject(10.0, 45.0)
                assert not replica.serving and replica.ejection.eject(10.0, 45.0) == 0  # once at a time
                now[0] += seconds - 0.5
                checks = fake.health.checks
                wait_until(lambda: fake.health.checks >= checks + 3)
                assert replica.ejection.ejected  # its time is not over
                now[0] += 0.5
                wait_until(lambda: replica.serving, message="never taken back")
                return seconds

            assert [ejected_for() for _ in range(5)] == [10.0, 20.0, 30.0, 40.0, 45.0]
            now[0] += 25.0  # served 2 bases since: 5 - 2, and this one
            assert ejected_for() == 40.0

            replica.ejection.eject(10.0, 45.0)
            fake.health.set(DECODE_SERVICE, NOT_SERVING)
            wait_until(lambda: not replica.healthy, message="NOT_SERVING never seen")  # no check before it in flight
            now[0] += 100.0
            checks = fake.health.checks
            wait_until(lambda: fake.health.checks >= checks + 3)
            assert replica.ejection.ejected  # its time is over, but its health says it does not serve
            fake.health.set(DECODE_SERVICE, SERVING)
            wait_until(lambda: replica.serving, message="never taken back")
        finally:
            replica.close()


def test_the_hang_flags_read_their_variables() -> None:
    env = {"KVSERVE_ROUTER_DECODE": "a:1", "KVSERVE_ROUTER_FIRST_TOKEN_TIMEOUT_S": "12.5",
           "KVSERVE_ROUTER_EJECT_AFTER": "5", "KVSERVE_ROUTER_EJECTION_S": "7"}
    args = parser().parse_args(env_args(parser(), "router", env))
    assert (args.first_token_timeout_s, args.eject_after, args.ejection_s) == (12.5, 5, 7.0)
    defaults = parser().parse_args(["--decode", "a:1"])
    assert (defaults.first_token_timeout_s, defaults.eject_after, defaults.ejection_s) == (30.0, 3, 30.0)
