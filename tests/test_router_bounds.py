"""What a decode replica tells the router, against the router's memory and its placement (docs/DESIGN.md,
"Router"; RELIABILITY.md). The attack: a replica (or anything answering on a --decode address) whose
`DecodeReplica.Events` sent 64 KiB "hashes" drove the router from 109 MiB to 5.2 GiB in about 70 s, still
rising, since its indexes were capped only in entries (1,000,000 each). Now every claim is checked
(protos/bounds.py), the indexes are capped in bytes, and a replica that lies is distrusted: its Events
stream cancelled, its indexes cleared, the lie counted; the router keeps serving with the others.

Replicas here are tests/fake_decode.py's, served over real gRPC in this process."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import itertools
import os
import threading
import time
import tracemalloc
from collections.abc import Iterable, Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from decode_service.replica import DecodeReplicaServicer, PoolEvents
from kvserve.router.index import ENTRY_BYTES, BlockIndex
from kvserve.router.router import Router
from kvserve.router.server import RouterMetrics
from kvserve.rpc.server import Server
from protos.block_hash import HASH_BYTES, BlockHash
from protos.bounds import (
    MAX_EVENT_HASHES,
    MAX_LOAD,
    MAX_PROMPT_HASHES,
    Lie,
    check_event,
    check_load,
    prompt_hashes,
)
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
from tests.fake_decode import FakeReplica, FakeServer
from tests.polling import wait_until
from tests.stack_fixtures import FakeRpcError

Event = kvstore_pb2.Event
STORED, REMOVED = Event.KIND_STORED, Event.KIND_REMOVED
ENTRY = HASH_BYTES + ENTRY_BYTES  # what one honest hash costs an index
HUGE = 64 << 10  # the attack's "hash"


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(i.to_bytes(4, "little")).digest())


def stored(hashes: Iterable[bytes], tier: int = kvstore_pb2.TIER_HOST) -> Event:
    return Event(kind=STORED, hashes=list(hashes), tier=tier)  # type: ignore[arg-type]


def rss_bytes(trimmed: bool = False) -> int:
    """This process's resident memory; `trimmed`: after a garbage collection, and glibc handing back the free
    memory it holds (the freed 4 MiB messages) where it can."""
    if trimmed:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- the index and the bounds, on their own ----------------------------------------------------


def test_an_index_is_capped_in_bytes_and_forgets_the_oldest() -> None:
    index = BlockIndex(capacity=1_000_000, capacity_bytes=10 * ENTRY)
    index.add([h(i) for i in range(25)])
    assert len(index) == 10 and index.nbytes == 10 * ENTRY
    assert h(14) not in index and all(h(i) in index for i in range(15, 25))
    index.remove([h(15), h(99)])
    assert len(index) == 9 and index.nbytes == 9 * ENTRY
    index.add([h(16)])  # seen again: counted once
    assert index.nbytes == 9 * ENTRY
    index.add([b"x" * HUGE])  # more than the whole budget: everything goes, itself included
    assert len(index) == 0 and index.nbytes == 0


def test_an_index_capped_only_in_entries_holds_every_byte_a_liar_names() -> None:
    """The router before: 1,000,000 entries and no byte cap. 64 hashes of 64 KiB (one 4 MiB event) cost it
    4 MiB; a budget in bytes keeps none of them."""
    liar = [i.to_bytes(4, "little") * (HUGE // 4) for i in range(64)]
    before = BlockIndex(capacity=1_000_000, capacity_bytes=1 << 62)
    before.add(liar)
    assert before.nbytes >= 64 * HUGE and len(before) == 64
    now = BlockIndex(capacity=1_000_000, capacity_bytes=HUGE)
    now.add(liar)
    assert now.nbytes == 0


def test_an_index_counts_at_least_what_python_allocates_for_it() -> None:
    """`nbytes` is an honest budget: the bytes objects and dict slots of 50,000 hashes, as a router takes
    them from an event, cost at most that and more than half of it."""
    event = stored(os.urandom(HASH_BYTES) for _ in range(50_000))
    index = BlockIndex(capacity=1_000_000, capacity_bytes=1 << 30)
    tracemalloc.start()
    try:
        index.add(event.hashes)
        allocated, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.nbytes == 50_000 * ENTRY
    assert index.nbytes // 2 < allocated <= index.nbytes


@pytest.mark.parametrize(("event", "reason"), [
    (stored([h(1), b"x" * HUGE]), "hash"),
    (stored([h(1), h(2)[:31]]), "hash"),
    (stored([]), None),
    (stored([h(i) for i in range(MAX_EVENT_HASHES)]), None),
    (stored([h(i) for i in range(MAX_EVENT_HASHES + 1)]), "count"),
    (Event(kind=Event.KIND_UNSPECIFIED, hashes=[h(1)], tier=kvstore_pb2.TIER_HOST), "kind"),
    (Event(kind=7, hashes=[h(1)], tier=kvstore_pb2.TIER_HOST), "kind"),  # type: ignore[arg-type]
    (Event(kind=REMOVED, hashes=[h(1)], tier=9), "tier"),  # type: ignore[arg-type]
    (Event(kind=REMOVED, hashes=[h(1)], tier=kvstore_pb2.TIER_ENGINE), None),
], ids=["64-KiB-hash", "31-byte-hash", "empty", "most", "one-too-many", "no-kind", "kind-7", "tier-9", "engine"])
def test_an_event_out_of_bounds_is_a_lie(event: Event, reason: str | None) -> None:
    if reason is None:
        check_event(event)
        return
    with pytest.raises(Lie) as lie:
        check_event(event)
    assert lie.value.reason == reason


def test_a_load_or_a_prompts_hashes_out_of_bounds_is_a_lie() -> None:
    assert check_load(decode_pb2.LoadResponse(running=MAX_LOAD - 1, waiting=1)) == MAX_LOAD
    with pytest.raises(Lie, match="load"):
        check_load(decode_pb2.LoadResponse(running=(1 << 32) - 1, waiting=(1 << 32) - 1))
    reply = decode_pb2.PrefixHashesResponse(hashes=[h(0), h(1)], prompt_tokens=33, block_size=16)
    assert prompt_hashes(reply) == [h(0), h(1)]
    assert prompt_hashes(decode_pb2.PrefixHashesResponse(prompt_tokens=33, block_size=16)) == []
    for bad, reason in [(decode_pb2.PrefixHashesResponse(hashes=[h(0), b"x" * HUGE], prompt_tokens=33, block_size=16),
                         "hash"),
                        (decode_pb2.PrefixHashesResponse(hashes=[h(0), h(1), h(2)], prompt_tokens=33, block_size=16),
                         "count"),
                        (decode_pb2.PrefixHashesResponse(hashes=[h(0)], prompt_tokens=33, block_size=0), "count")]:
        with pytest.raises(Lie) as lie:
            prompt_hashes(bad)
        assert lie.value.reason == reason
    long = decode_pb2.PrefixHashesResponse(hashes=[h(i) for i in range(MAX_PROMPT_HASHES + 10)],
                                           prompt_tokens=16 * (MAX_PROMPT_HASHES + 10), block_size=16)
    assert prompt_hashes(long) == [h(i) for i in range(MAX_PROMPT_HASHES)]  # placed by its first 64 Ki tokens


# --- a real router in front of fake replicas --------------------------------------------------------


def serve(replica: FakeReplica) -> FakeServer:
    return FakeServer(replica=replica).__enter__()


def routed(*replicas: FakeServer, distrust_s: float = 60.0, index_bytes: int = 1 << 20
           ) -> tuple[Router, CollectorRegistry]:
    router = Router([r.addr for r in replicas], poll_s=0.05, distrust_s=distrust_s, index_bytes=index_bytes)
    registry = CollectorRegistry()
    router.on_route = RouterMetrics(registry, router).observe
    router.start()
    wait_until(lambda: router.num_healthy == len(replicas), message="the router never saw its replicas healthy")
    return router, registry


def lies(registry: CollectorRegistry, replica: str, reason: str) -> float:
    return registry.get_sample_value("kvserve_router_replica_lies_total", {"replica": replica, "reason": reason}) or 0.0


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    started: list[FakeServer] = []
    yield started
    for s in started:
        s.__exit__(None, None, None)


def test_an_honest_replicas_events_are_indexed_as_before(servers: list[FakeServer]) -> None:
    prompt = [h(i) for i in range(8)]
    honest = FakeReplica(lambda n: [
        stored(prompt[:6]),
        stored(prompt[4:8], kvstore_pb2.TIER_ENGINE),
        Event(kind=REMOVED, hashes=prompt[5:6], tier=kvstore_pb2.TIER_DISK),
        stored([h(i) for i in range(100, 100 + MAX_EVENT_HASHES)], kvstore_pb2.TIER_DISK),  # as big as may be
    ], load=decode_pb2.LoadResponse(running=3, waiting=1))
    servers.append(serve(honest))
    router, registry = routed(*servers, index_bytes=64 << 20)
    try:
        replica = router.replicas[servers[0].addr]
        wait_until(lambda: len(replica.blocks.store) == 5 + MAX_EVENT_HASHES and len(replica.blocks.pool) == 4)
        assert replica.blocks.store.nbytes == (5 + MAX_EVENT_HASHES) * ENTRY and replica.blocks.pool.nbytes == 4 * ENTRY
        assert prompt[5] not in replica.blocks.store and prompt[5] in replica.blocks.pool
        assert router.choose(prompt) == (replica, 8)
        wait_until(lambda: replica.load == 4)
        assert replica.blocks.trusted and router.lies() == {} and registry.get_sample_value(
            "kvserve_router_index_bytes") == (9 + MAX_EVENT_HASHES) * ENTRY
    finally:
        router.close()


@pytest.mark.slow
def test_a_replica_sending_64_kib_hashes_is_dropped_and_the_router_stays_flat(servers: list[FakeServer]) -> None:
    """The attack, from a replica that first claims a prompt, then sends 4 MiB events of 63 new 64 KiB hashes
    each. Before, every hash was kept: the issue saw 5.2 GiB after 70 s, and this test's process grew by 240
    MiB after 200 MiB sent (measured with the router of before). Now the liar is dropped at its first 64 KiB
    hash each time it is heard, and the process stays flat. Memory is measured while the liar holds its
    next stream at a gate, so that no message is in flight, after 100 MiB sent and 200 MiB later."""
    prompt = [h(i) for i in range(8)]
    padding = bytes(HUGE - 8)
    gate = threading.Event()
    held: set[int] = set()  # streams waiting at the gate, having sent nothing

    def attack(n: int) -> Iterator[Event]:
        held.add(n)
        gate.wait()
        held.discard(n)
        if n == 0:
            yield stored(prompt)  # first a claim that would pull the prompt there
        for k in itertools.count(step=63):
            yield stored((k + i).to_bytes(8, "little") + padding for i in range(63))  # 4 MiB: gRPC's limit

    def at_rest() -> tuple[int, int]:
        """(Python's traced memory, resident memory) while no message is in flight."""
        gate.clear()
        wait_until(lambda: liar.streams - 1 in held and lies(registry, bad.addr, "hash") == liar.streams - 1,
                   message="the liar's streams never came to rest")
        rss = rss_bytes(trimmed=True)
        traced, _ = tracemalloc.get_traced_memory()
        gate.set()
        return traced, rss

    def sent(n: int) -> None:
        wait_until(lambda: liar.sent_bytes >= n, timeout_s=300, interval_s=0.05,
                   message=lambda: f"the liar sent only {liar.sent_bytes >> 20} MiB")

    liar = FakeReplica(attack)
    honest = FakeReplica(lambda n: [stored(prompt[:4])])
    servers += [serve(liar), serve(honest)]
    router, registry = routed(*servers, distrust_s=0.01)
    bad, good = router.replicas[servers[0].addr], router.replicas[servers[1].addr]
    tracemalloc.start()
    try:
        gate.set()
        sent(100 << 20)  # the allocator's pools warmed up
        (traced, rss), before = at_rest(), liar.sent_bytes
        sent(before + (200 << 20))
        (traced_after, rss_after), after = at_rest(), liar.sent_bytes

        assert after - before >= 200 << 20 and lies(registry, bad.addr, "hash") == liar.streams - 1 >= 10
        assert len(bad.blocks.store) == len(bad.blocks.pool) == 0 and bad.blocks.store.nbytes == bad.blocks.pool.nbytes == 0
        assert router.index_bytes == good.blocks.store.nbytes == 4 * ENTRY
        assert router.choose(prompt) == (good, 4)  # its claim steers nothing
        # Python's heap, where the index of before kept every hash: flat but for a few objects a stream.
        assert traced_after - traced < 1 << 20, f"Python's heap grew by {traced_after - traced} bytes"
        # The whole process, the allocator's noise included (3-48 MiB measured; the router of before: 240).
        assert rss_after - rss < 96 << 20, f"the process grew by {(rss_after - rss) >> 20} MiB"
    finally:
        tracemalloc.stop()
        gate.set()
        router.close()


@pytest.mark.parametrize(("lie", "reason"), [
    (stored([h(i) for i in range(MAX_EVENT_HASHES + 1)]), "count"),
    (Event(kind=Event.KIND_UNSPECIFIED, hashes=[h(1)], tier=kvstore_pb2.TIER_HOST), "kind"),
    (Event(kind=STORED, hashes=[h(1)], tier=42), "tier"),  # type: ignore[arg-type]
], ids=["one-too-many", "no-kind", "tier-42"])
def test_oversized_events_and_unknown_kinds_or_tiers_drop_the_replica(
        servers: list[FakeServer], lie: Event, reason: str) -> None:
    claimed = [h(i) for i in range(8)]
    liar = FakeReplica(lambda n: [stored(claimed), stored(claimed[:2], kvstore_pb2.TIER_ENGINE), lie] * 50)
    servers.append(serve(liar))
    router, registry = routed(*servers)
    try:
        replica = router.replicas[servers[0].addr]
        wait_until(lambda: lies(registry, replica.addr, reason) == 1)
        assert not replica.blocks.trusted and replica.blocks.lie is not None and replica.blocks.lie.reason == reason
        assert len(replica.blocks.store) == len(replica.blocks.pool) == 0 and router.index_bytes == 0
        assert registry.get_sample_value("kvserve_router_distrusted_replicas") == 1
        assert router.choose(claimed) == (replica, 0)  # still served by load, its claims steer nothing
        assert liar.streams == 1  # not heard again before distrust_s
    finally:
        router.close()


def test_a_replica_lying_about_its_load_or_a_prompts_hashes_is_distrusted(servers: list[FakeServer]) -> None:
    prompt = [h(i) for i in range(4)]
    loud = FakeReplica(lambda n: [stored(prompt)], load=decode_pb2.LoadResponse(running=1 << 31, waiting=1 << 31))
    forger = FakeReplica(lambda n: [stored(prompt)],
                         prefix=decode_pb2.PrefixHashesResponse(hashes=[b"x" * HUGE], prompt_tokens=16, block_size=16))
    servers += [serve(loud), serve(forger)]
    router, registry = routed(*servers)
    try:
        a, b = router.replicas[servers[0].addr], router.replicas[servers[1].addr]
        wait_until(lambda: lies(registry, a.addr, "load") == 1)
        assert a.load == 0 and len(a.blocks.store) == 0
        wait_until(lambda: len(b.blocks.store) == 4)
        request = decode_pb2.GenerateRequest()
        assert router.prefix_hashes(request, [], 5.0) == []  # the forger's answer is not used, nor asked again
        assert lies(registry, b.addr, "hash") == 1 and len(b.blocks.store) == 0
        assert router.prefix_hashes(request, [], 5.0) == []
        assert lies(registry, b.addr, "hash") == 1
    finally:
        router.close()


def test_prefix_hashes_are_asked_with_the_routers_token_for_the_callers_tenant(servers: list[FakeServer]) -> None:
    """Decode's internal API answers only a service token; the caller's token names the tenant whose
    namespace the hashes are in (kvserve/rpc/auth.py). A refused token places the request by load."""
    prompt = [h(i) for i in range(4)]
    replica = FakeReplica(prefix=decode_pb2.PrefixHashesResponse(hashes=prompt, prompt_tokens=64, block_size=16))
    servers.append(serve(replica))
    router = Router([servers[0].addr], poll_s=0.05, metadata=[("authorization", "Bearer router-token")])
    router.start()
    try:
        wait_until(lambda: router.num_healthy == 1)
        assert router.prefix_hashes(decode_pb2.GenerateRequest(), [("authorization", "Bearer tenant-token")],
                                    5.0) == prompt
        asked = replica.prefix_metadata[-1]
        assert asked["authorization"] == "Bearer router-token"
        assert asked["kvserve-on-behalf-of"] == "Bearer tenant-token"
        replica.refuse = grpc.StatusCode.PERMISSION_DENIED
        assert router.prefix_hashes(decode_pb2.GenerateRequest(), [], 5.0) == []
        assert "kvserve-on-behalf-of" not in replica.prefix_metadata[-1]
    finally:
        router.close()


# --- the decode replica's relay of its store's events ---------------------------------------------


class FakeStoreEvents:
    """A store client whose Events stream sends `events`, then stays open until cancelled."""

    addr = "store.test:50053"

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    def watch_events(self) -> Iterator[Event]:
        cancelled = threading.Event()
        events = self.events

        class Call:
            def __iter__(self) -> Iterator[Event]:
                yield from events
                cancelled.wait()

            def cancel(self) -> None:
                cancelled.set()

        return Call()  # type: ignore[return-value]


def relayed(store: FakeStoreEvents, pool: PoolEvents, most: int) -> tuple[list[Event], grpc.RpcError | None]:
    """What a decode replica's Events sends, up to `most` events (the stream then stays open), and the
    status it ended with before that, if it did."""
    servicer = DecodeReplicaServicer(None, None, store, None, pool)  # type: ignore[arg-type]
    server = Server("127.0.0.1:0")
    server.add(decode_pb2_grpc.add_DecodeReplicaServicer_to_server, servicer, "kvserve.v1.DecodeReplica")
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = decode_pb2_grpc.DecodeReplicaStub(channel).Events(kvstore_pb2.EventsRequest(), timeout=60)
            got: list[Event] = []
            try:
                got += itertools.islice(call, most)
            except grpc.RpcError as exc:
                return got, exc
            call.cancel()
            return got, None
    finally:
        server.stop(0)


def test_the_replica_relays_its_pool_and_store_in_pieces_a_router_takes() -> None:
    pool = PoolEvents()
    pool.changed([h(i) for i in range(MAX_EVENT_HASHES + 5)], [])
    store = FakeStoreEvents([stored([h(i) for i in range(10_000)])])  # the store batches up to 10,000
    got, ended = relayed(store, pool, 5)
    assert ended is None and [(e.tier, len(e.hashes)) for e in got] == [
        (kvstore_pb2.TIER_ENGINE, MAX_EVENT_HASHES), (kvstore_pb2.TIER_ENGINE, 5),
        (kvstore_pb2.TIER_HOST, MAX_EVENT_HASHES), (kvstore_pb2.TIER_HOST, MAX_EVENT_HASHES),
        (kvstore_pb2.TIER_HOST, 10_000 - 2 * MAX_EVENT_HASHES)]
    assert [x for e in got[2:] for x in e.hashes] == [h(i) for i in range(10_000)]


class RefusingFirstStoreEvents(FakeStoreEvents):
    """Refuses its first Events stream (RESOURCE_EXHAUSTED: a store serving as many as it will), then sends
    `events` as FakeStoreEvents does."""

    def __init__(self, events: list[Event]) -> None:
        super().__init__(events)
        self.asked = 0

    def watch_events(self) -> Iterator[Event]:
        self.asked += 1
        if self.asked > 1:
            return super().watch_events()

        class Refused:
            def __iter__(self) -> Iterator[Event]:
                raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)

            def cancel(self) -> None:
                pass

        return Refused()  # type: ignore[return-value]


def test_a_replica_whose_store_refuses_its_events_goes_on_with_its_pools_and_asks_the_store_again() -> None:
    """The pool's events are not lost with the store's stream: the replica's own stream goes on, and the store's
    is asked again (after half a second) and relayed once it is taken."""
    pool = PoolEvents()
    pool.changed([h(1), h(2)], [])
    store = RefusingFirstStoreEvents([stored([h(7)])])
    got, ended = relayed(store, pool, 2)
    assert ended is None and store.asked == 2
    assert [(e.tier, list(e.hashes)) for e in got] == [(kvstore_pb2.TIER_ENGINE, [h(1), h(2)]),
                                                       (kvstore_pb2.TIER_HOST, [h(7)])]


@pytest.mark.parametrize("bad", [
    stored([h(1), b"x" * HUGE]),
    stored([h(1)], kvstore_pb2.TIER_ENGINE),  # the store speaking for the replica's own pool
    Event(kind=Event.KIND_UNSPECIFIED, hashes=[h(1)], tier=kvstore_pb2.TIER_HOST),
], ids=["64-KiB-hash", "engine-tier", "no-kind"])
def test_the_replica_ends_its_events_on_a_store_event_out_of_bounds(bad: Event) -> None:
    store = FakeStoreEvents([stored([h(0)]), bad, stored([h(2)])])
    got, ended = relayed(store, PoolEvents(), 10)
    assert isinstance(ended, grpc.Call) and ended.code() == grpc.StatusCode.UNAVAILABLE
    assert "out of bounds" in (ended.details() or "")
    assert [list(e.hashes) for e in got] == [[], [h(0)]]  # the empty pool's snapshot, then the good event only


def test_a_replica_whose_events_keep_ending_is_followed_again_later_and_later_and_keeps_its_pool(
        servers: list[FakeServer]) -> None:
    """Its pool's snapshot, then an error, every time (its store refusing one more Events stream, say): the router
    follows it again after 0.5, 1, 2 s and so on, not every half second, and between two streams what it
    knew of the pool stays known; each new snapshot takes its place whole."""
    pool = [h(i) for i in range(4)]

    def events(n: int) -> Iterator[Event]:
        yield stored(pool, kvstore_pb2.TIER_ENGINE)
        raise RuntimeError("its store refused another Events stream")

    replica = FakeReplica(events)
    servers.append(serve(replica))
    router, _ = routed(*servers)
    try:
        followed = router.replicas[servers[0].addr]
        wait_until(lambda: len(followed.blocks.pool) == 4)
        held = []
        end = time.monotonic() + 3.2
        while time.monotonic() < end:
            held.append(followed.blocks.leading(pool))
            time.sleep(0.002)
        assert replica.streams <= 4, replica.streams  # at 0, 0.5, 1.5 and 3.5 s; every 0.5 s would be 7
        assert min(held) == 4
    finally:
        router.close()
