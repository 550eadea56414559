"""The router's parts on their own: the block index, name resolution and the placement policies
(replicas whose state a test sets; nothing listens at their addresses), then the router in front of
prefill and decode in this process. A deployment of real processes is tests/test_router_deployment.py."""

from __future__ import annotations

import hashlib
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from client import Client
from client.client import InvalidArgumentError, build_request
from kvserve.engine.sampling import SamplingParams
from kvserve.handoff.requests import PromptInput, RequestOptions
from kvserve.router.__main__ import parser
from kvserve.router.index import ENTRY_BYTES, BlockIndex
from kvserve.router.replica import DECODE_SERVICE
from kvserve.router.router import Router
from kvserve.router.server import RouterServicer
from kvserve.rpc.addresses import resolve
from kvserve.rpc.cli import env_args
from kvserve.rpc.server import Server
from prefill_service.client import PrefillClient, PrefillReplicas
from protos.block_hash import BlockHash
from protos.kvserve.v1 import decode_pb2_grpc
from protos.retry import Backoff
from tests.polling import wait_until
from tests.stack_fixtures import BLOCK_SIZE, LocalStack, assert_greedy_matches, oracle, tokens

ARCH = "llama"


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(i.to_bytes(4, "little")).digest())


def test_the_index_holds_hashes_and_forgets_the_oldest() -> None:
    index = BlockIndex(capacity=3)
    index.add([h(1), h(2), h(3)])
    assert all(h(i) in index for i in (1, 2, 3)) and h(4) not in index
    index.add([h(1)])  # seen again: now the newest
    index.add([h(4)])  # over capacity: h(2), the oldest, goes
    assert h(1) in index and h(2) not in index and len(index) == 3
    index.remove([h(1), h(42)])
    assert h(1) not in index and len(index) == 2
    assert index.nbytes == 2 * (32 + ENTRY_BYTES)  # what it holds, in bytes: capped too (test_router_bounds.py)
    index.clear()
    assert len(index) == 0 and index.nbytes == 0


def test_resolve_names_every_address_of_a_name() -> None:
    assert resolve("10.1.2.3:50051") == [("10.1.2.3:50051", None)]
    assert resolve("[::1]:50051") == [("[::1]:50051", None)]
    assert resolve("localhost:50051") == [("localhost:50051", None)]
    assert resolve("no-such-host.invalid:50051") == []
    with pytest.raises(ValueError, match="HOST:PORT"):
        resolve("decode")


class Placed:
    """A prefill call as a fake replica's `start` returns it: where it went, and nothing on the wire."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.ended: list[Callable[[], None]] = []

    def on_done(self, fn: Callable[[], None]) -> None:
        self.ended.append(fn)

    def end(self) -> None:
        for fn in self.ended:
            fn()


def place(replicas: PrefillReplicas) -> Placed:
    """The replica a prefill call goes to, through PrefillReplicas' public start."""
    return replicas.start("r", PromptInput(text="hi"), RequestOptions(SamplingParams()))  # type: ignore[return-value]


def test_a_name_with_several_addresses_is_several_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"decode.kvserve.svc": ["10.0.0.7", "10.0.0.5"]}

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        if host not in answers:
            raise socket.gaierror("not found")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(PrefillClient, "start", lambda self, *args, **kwargs: Placed(self.addr))
    assert resolve("decode.kvserve.svc:50051") == [("10.0.0.5:50051", "decode.kvserve.svc"),
                                                   ("10.0.0.7:50051", "decode.kvserve.svc")]
    replicas = PrefillReplicas.connect("decode.kvserve.svc:50052, 10.0.0.9:50052", resolve_every_s=0)
    try:
        assert [c.addr for c in replicas.clients] == ["10.0.0.5:50052", "10.0.0.7:50052", "10.0.0.9:50052"]
        answers["decode.kvserve.svc"] = ["10.0.0.7"]  # scaled down: the next call resolves again
        replicas.mark_down("10.0.0.9:50052")
        assert place(replicas).addr == "10.0.0.7:50052"
        assert [c.addr for c in replicas.clients] == ["10.0.0.7:50052", "10.0.0.9:50052"]
        del answers["decode.kvserve.svc"]  # the resolver fails for a moment: the last addresses stay
        place(replicas)
        assert [c.addr for c in replicas.clients] == ["10.0.0.7:50052", "10.0.0.9:50052"]
    finally:
        replicas.close()
    with pytest.raises(ValueError, match="HOST:PORT"):
        PrefillReplicas.connect("prefill")


def test_a_replica_gone_from_its_name_keeps_its_streams_until_they_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode replica the name no longer resolves to (scaled down, not ready for a moment) gets no new request,
    and its channel closes only once the router's streams on it have ended (closing it would end them
    CANCELLED); back before that, it is taken back as it is."""
    answers = {"decode.kvserve.svc": ["10.0.0.5", "10.0.0.7"]}

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    r = Router(["decode.kvserve.svc:50051"])
    try:
        leaving = r.replicas["10.0.0.7:50051"]
        leaving.started()  # a stream on it
        answers["decode.kvserve.svc"] = ["10.0.0.5"]
        r.resolve()
        assert list(r.replicas) == ["10.0.0.5:50051"] and not leaving.closed
        answers["decode.kvserve.svc"] = ["10.0.0.5", "10.0.0.7"]  # back: the same replica, its stream still on
        r.resolve()
        assert r.replicas["10.0.0.7:50051"] is leaving
        answers["decode.kvserve.svc"] = ["10.0.0.5"]
        r.resolve()
        leaving.ended()
        assert not leaving.closed
        r.resolve()  # its last stream ended: now its channel closes
        assert leaving.closed and list(r.replicas) == ["10.0.0.5:50051"]
    finally:
        r.close()


def test_a_slow_resolver_holds_up_only_the_request_that_asks_it() -> None:
    """Resolving the prefill replicas again (DNS, slow or down) happens outside the lock, one request at a time:
    the others pick among the replicas known meanwhile, and so do the calls that end."""
    class Known:
        addr = "10.0.0.7:50052"

        def start(self, *args: object, **kwargs: object) -> Placed:
            return Placed(self.addr)

    resolving, answered = threading.Event(), threading.Event()

    def slow() -> list[Known]:
        resolving.set()
        answered.wait(10)
        return [Known()]

    replicas = PrefillReplicas([Known()], resolve=slow, resolve_every_s=0)  # type: ignore[list-item,arg-type]
    asking = threading.Thread(target=place, args=(replicas,))
    asking.start()
    try:
        assert resolving.wait(10), "the resolver was never asked"
        start = time.monotonic()
        picked = place(replicas)
        picked.end()
        assert time.monotonic() - start < 1.0 and picked.addr == "10.0.0.7:50052"
    finally:
        answered.set()
        asking.join(10)


def router(policy: str, n: int = 3, load_weight: float = 4.0) -> Router:
    r = Router([f"127.0.0.1:{1 + i}" for i in range(n)], policy=policy, load_weight=load_weight)
    for replica in r.replicas.values():
        replica.healthy = True
    return r


def test_prefix_goes_where_the_leading_blocks_are_until_that_replica_is_much_busier() -> None:
    r = router("prefix")
    a, b, c = r.replicas.values()
    prompt = [h(i) for i in range(10)]
    b.blocks.store.add(prompt[:6])
    c.blocks.store.add(prompt[:2])
    for _ in range(6):  # whichever replica's turn it is
        assert r.choose(prompt) == (b, 6)
    b.others_load = 1  # 4 blocks left + 4 x 1 = 8 < 10 (a) and 8 (c): ties go round
    assert r.choose(prompt) in ((b, 6), (c, 2))
    b.in_flight = 2  # the router's own requests come on top: 4 + 4 x 3 = 16 > 8 (c)
    assert r.choose(prompt) == (c, 2)
    b.healthy = c.healthy = False
    assert r.choose(prompt) == (a, 0)
    assert r.choose(prompt, avoid=[a.addr]) is None


def test_a_replicas_pool_counts_as_holding_its_blocks() -> None:
    r = router("prefix")
    a, b, c = r.replicas.values()
    prompt = [h(i) for i in range(10)]
    c.blocks.store.add(prompt[:5])  # in c's node store
    b.blocks.pool.add(prompt[:4])  # in b's KV pool, and the rest of its history in its node store
    b.blocks.store.add(prompt[4:8])
    assert r.choose(prompt) == (b, 8)
    b.blocks.pool.remove(prompt[:1])  # evicted from b's pool: its store blocks no longer lead
    assert r.choose(prompt) == (c, 5)


def test_without_a_prefix_every_policy_spreads_requests() -> None:
    for policy in ("prefix", "least-loaded", "round-robin"):
        r = router(policy)
        chosen = {r.choose([h(1)])[0].addr for _ in range(6)}  # type: ignore[index]
        assert chosen == set(r.replicas), policy


def test_new_chats_of_two_turns_spread_and_each_stays_where_it_began() -> None:
    r = router("prefix", n=2)
    first_turns = []
    for chat in range(4):
        prompt = [h(100 * chat + i) for i in range(8)]
        first, _ = r.choose(prompt)  # type: ignore[misc]
        first.blocks.store.add(prompt)  # as generate does once the replica answers
        first_turns.append(first.addr)
        assert r.choose([*prompt, h(100 * chat + 50)])[0] is first  # type: ignore[index]
    assert sorted(first_turns) == sorted(list(r.replicas) * 2)


def test_least_loaded_ignores_prefixes_and_round_robin_ignores_load() -> None:
    r = router("least-loaded")
    a, b, c = r.replicas.values()
    a.blocks.store.add([h(1)])
    a.others_load, b.others_load, c.others_load = 5, 0, 2
    assert r.choose([h(1)]) == (b, 0)
    rr = router("round-robin", n=2)
    x, y = rr.replicas.values()
    x.others_load = 100
    assert [rr.choose([])[0].addr for _ in range(4)].count(x.addr) == 2  # type: ignore[index]


def test_unknown_policy_and_missing_replicas_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Router(["127.0.0.1:1"], policy="random")
    with pytest.raises(ValueError, match="at least one"):
        Router([])


def test_every_router_flag_reads_its_variable() -> None:
    env = {"KVSERVE_ROUTER_DECODE": "a:1,b:2", "KVSERVE_ROUTER_POLICY": "round-robin",
           "KVSERVE_ROUTER_LOAD_WEIGHT": "2.5"}
    args = parser().parse_args(env_args(parser(), "router", env))
    assert (args.decode, args.policy, args.load_weight) == ("a:1,b:2", "round-robin", 2.5)


# --- in front of a replica in this process ------------------------------------------------------


@pytest.fixture(scope="module")
def replica() -> Iterator[LocalStack]:
    s = LocalStack(ARCH)
    yield s
    s.close()


@pytest.fixture(scope="module")
def routed(replica: LocalStack) -> Iterator[tuple[Router, Client]]:
    """A router in front of the replica and of an address where nothing listens."""
    router = Router(["127.0.0.1:1", replica.addr], policy="prefix", poll_s=0.1)
    router.start()
    server = Server("127.0.0.1:0")
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, RouterServicer(router), DECODE_SERVICE)
    port = server.start()
    wait_until(lambda: router.num_healthy >= 1, interval_s=0.02, message="the router never saw its replica healthy")
    with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
        yield router, client
    server.stop(0)
    router.close()


def test_answers_through_the_router_are_the_replicas(routed: tuple[Router, Client]) -> None:
    _, client = routed
    ids = tokens(3 * BLOCK_SIZE + 5, seed=41)
    want, logits = oracle(ARCH, ids, 8)
    result = client.generate(token_ids=ids, max_tokens=8, ignore_eos=True)
    assert_greedy_matches(list(result.token_ids), want, logits)
    streamed = [c.token_id for c in client.stream(token_ids=ids, max_tokens=8, ignore_eos=True)
                if hasattr(c, "token_id")]
    assert streamed == list(result.token_ids)


def test_the_router_learns_where_a_prompt_went(routed: tuple[Router, Client], replica: LocalStack) -> None:
    router, client = routed
    ids = tokens(4 * BLOCK_SIZE + 1, seed=42)
    client.generate(token_ids=ids, max_tokens=2, ignore_eos=True)
    req = build_request(token_ids=ids, max_tokens=2)
    hashes = router.prefix_hashes(req, [], 5.0)
    assert len(hashes) == 4
    assert router.choose(hashes) == (router.replicas[replica.addr], 4)


def test_the_callers_errors_come_back_as_the_replica_gave_them(routed: tuple[Router, Client]) -> None:
    _, client = routed
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        client.generate(token_ids=[5, 1 << 20])
    with pytest.raises(InvalidArgumentError, match="top_p"):
        client.generate("hi", top_p=2.0)


def test_a_replica_that_fails_before_the_first_token_is_replaced(replica: LocalStack) -> None:
    router = Router(["127.0.0.1:1", replica.addr], policy="round-robin", poll_s=60)
    for r in router.replicas.values():
        r.healthy = True  # the dead one too, as before a health check has noticed
    req = build_request(token_ids=tokens(BLOCK_SIZE, seed=43), max_tokens=3, ignore_eos=True)
    try:
        for _ in range(2):  # whichever comes first in turn
            out = list(router.generate(req, [], lambda: 30.0, lambda call: None))
            assert out[-1].WhichOneof("kind") == "result"
        assert not router.replicas["127.0.0.1:1"].healthy
    finally:
        router.close()


def test_a_stream_that_keeps_ending_is_followed_again_later_and_later() -> None:
    backoff = Backoff(initial_s=0.5, max_s=5.0, stable_s=5.0)
    assert [backoff.delay(0.1) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.delay(60.0) == 0.5 and backoff.delay(0.1) == 1.0  # one that lasted: from the start again


def test_a_jittered_backoff_stays_under_its_step_and_waits_out_a_hint() -> None:
    backoff = Backoff(initial_s=0.05, max_s=2.0, jitter=True, rng=random.Random(7))
    waits = [backoff.delay() for _ in range(8)]
    steps = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert all(0 <= w <= s for w, s in zip(waits, steps, strict=True)) and len(set(waits)) == 8
    assert backoff.next_s == 2.0 and 1.5 <= backoff.delay(hint_s=1.5) <= 2.0  # at least the hint, never past the cap
