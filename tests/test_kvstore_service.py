"""The store behind a real gRPC server on port 0: streaming, concurrency, integrity, bad inputs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.rpc.server import CHANNEL_OPTIONS
from kvstore import KVStoreClient, arena
from kvstore.block_format import checksum
from kvstore.config import StoreConfig
from kvstore.server import StoreServer
from kvstore.types import Tier
from protos.kvserve.v1 import kvstore_pb2 as pb
from protos.kvserve.v1 import kvstore_pb2_grpc as pb_grpc
from tests.kvstore_fixtures import REPO, corrupt_lmdb_value, key, payload, run_in_threads, running_server
from tests.polling import wait_until

MiB = 1024 * 1024


def healthy(server: StoreServer) -> bool:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvserve.v1.KVStore"))
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def status_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


class WireTap(pb_grpc.KVStoreServicer):
    """A KVStore service on a port of its own that forwards each call to a real store server,
    message by message: a client pointed at it is watched on the wire (`put_requests`,
    `get_requests`), and a test can act when a Get arrives or on each answer (`before_get`,
    `on_get_response`) or rewrite what Info answers (`on_info`). Neither side is patched."""

    def __init__(self, target: str) -> None:
        self.put_requests: list[pb.PutRequest] = []
        self.get_requests: list[pb.GetRequest] = []
        self.before_get: Callable[[pb.GetRequest], None] = lambda request: None
        self.on_get_response: Callable[[pb.GetResponse], None] = lambda response: None
        self.on_info: Callable[[pb.InfoResponse], None] = lambda reply: None
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._server = grpc.server(ThreadPoolExecutor(8), options=CHANNEL_OPTIONS)
        pb_grpc.add_KVStoreServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def __enter__(self) -> WireTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)
        self._channel.close()

    def _unary(self, method: Callable[..., Any], request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(request, timeout=context.time_remaining())
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        return self._unary(self._stub.Lookup, request, context)

    def Put(self, request_iterator: Iterator[pb.PutRequest], context: grpc.ServicerContext) -> pb.PutResponse:
        def watched() -> Iterator[pb.PutRequest]:
            for request in request_iterator:
                self.put_requests.append(request)
                yield request

        return self._unary(self._stub.Put, watched(), context)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:
        self.get_requests.append(request)
        self.before_get(request)
        try:
            for response in self._stub.Get(request, timeout=context.time_remaining()):
                self.on_get_response(response)
                yield response
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details())

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return self._unary(self._stub.Release, request, context)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return self._unary(self._stub.Stats, request, context)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        reply = self._unary(self._stub.Info, request, context)
        self.on_info(reply)
        return reply



@pytest.mark.parametrize(("server_shm", "use_shm"), [(True, False), (True, True), (False, True)])
def test_10_mib_block_round_trip(tmp_path: Path, server_shm: bool, use_shm: bool) -> None:
    big = payload("big", 10 * MiB + 123)
    running = running_server(tmp_path, host_capacity=64 * MiB, shm=server_shm)
    with running as server, KVStoreClient(server.address, use_shm=use_shm) as c:
        assert (c.shm_dir() is not None) == (use_shm and server_shm)
        assert c.put([(key("big"), big)]) == 1
        assert c.put([(key("big"), big)]) == 0
        assert c.get([key("big"), key("none")]) == [big, None]
        assert c.lookup([key("big")]).tiers == ["host"]
        stats = c.stats()
        assert (stats.tier("host").blocks, stats.tier("host").bytes) == (1, len(big))


def test_shm_and_grpc_paths_give_identical_bytes(tmp_path: Path) -> None:
    blocks = [(key(i), payload(i, 1000 + i)) for i in range(20)]
    with running_server(tmp_path) as server:
        with KVStoreClient(server.address) as local:
            assert local.put(blocks) == 20
            via_shm = local.get([k for k, _ in blocks])
            bufs = [memoryview(bytearray(2000)) for _ in blocks]
            sizes = local.get_into([k for k, _ in blocks], bufs)
        with KVStoreClient(server.address, use_shm=False) as remote:
            via_grpc = remote.get([k for k, _ in blocks])
    assert via_shm == via_grpc == [p for _, p in blocks]
    assert [bytes(b[:n]) for b, n in zip(bufs, sizes, strict=True) if n is not None] == via_grpc


def test_block_removed_after_info_falls_back_to_grpc(tmp_path: Path) -> None:
    config = dict(host_capacity=3000, disk_capacity=100_000, disk_path=tmp_path / "db")
    with (running_server(tmp_path, **config) as server, WireTap(server.address) as tap,
          KVStoreClient(tap.address) as c):
        store = server.store
        assert c.shm_dir() is not None
        c.put([(key(i), payload(i, 1000)) for i in range(3)])
        c.put([(key(i), payload(i, 1000)) for i in range(3, 6)])  # 0..2 demoted: their slots are free
        assert c.get([key(0), key(4)]) == [payload(0, 1000), payload(4, 1000)]

        # Block 1 is on disk. While this client asks for it, another reader promotes it (the store
        # answers with its arena slot), and writers demote it again and the slot is reused before
        # this client copies it: the copy fails its checksum and it asks once more, for bytes.
        assert store.tier_of(key(1)) == Tier.DISK
        answers: list[str] = []

        def promote(request: pb.GetRequest) -> None:
            if not answers:
                assert list(store.get([key(1)]))[0] is not None
                assert store.tier_of(key(1)) == Tier.HOST

        def demote(response: pb.GetResponse) -> None:
            answers.append("shm_offset" if response.slots else "bytes")
            if answers == ["shm_offset"]:
                for i in range(6, 9):
                    store.put(key(i), payload(i, 1000))
                assert store.tier_of(key(1)) == Tier.DISK
                offset = response.slots[0].shm_offset
                store.shm_tier.arena.view[offset : offset + 1000] = payload(9, 1000)  # type: ignore[union-attr]

        tap.get_requests.clear()
        tap.before_get, tap.on_get_response = promote, demote
        assert c.get([key(1)]) == [payload(1, 1000)]
        assert [(r.via_shm, list(r.hashes)) for r in tap.get_requests] == [(True, [key(1)]), (False, [key(1)])]
        assert answers == ["shm_offset", "bytes"]
        store.check_integrity()


def test_eight_threads_put_and_get_byte_exact(tmp_path: Path) -> None:
    with running_server(tmp_path, host_capacity=2 * MiB, disk_capacity=64 * MiB, disk_path=tmp_path / "db") as server:

        def work(t: int) -> None:
            with KVStoreClient(server.address, timeout_s=30, use_shm=t % 2 == 0) as c:
                for round_ in range(6):
                    blocks = [(key(f"{t}-{round_}-{i}"), payload(f"{t}-{round_}-{i}", 20_000 + t)) for i in range(8)]
                    assert c.put(blocks) == 8
                    shared = [(key(f"shared-{i}"), payload(f"shared-{i}", 30_000)) for i in range(4)]
                    c.put(shared)
                    got = c.get([k for k, _ in blocks + shared])
                    assert got == [p for _, p in blocks + shared]

        run_in_threads(work)
        server.store.check_integrity()
        stats = server.store.stats()
        assert stats.tier("host").bytes <= 2 * MiB and stats.tier("disk").demotions == 0
        assert sum(t.blocks for t in stats.tiers) == 8 * 6 * 8 + 4


def test_bad_inputs_get_precise_codes_and_server_stays_healthy(tmp_path: Path) -> None:
    with running_server(tmp_path, host_capacity=1 * MiB) as server, KVStoreClient(server.address, use_shm=False) as c:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(lambda: c.lookup([b"short"])) == invalid
        assert status_of(lambda: c.get([b"short"])) == invalid
        assert status_of(lambda: c.put([(b"short", b"x")])) == invalid
        assert status_of(lambda: c.put([])) == invalid
        assert status_of(lambda: c.put([(key(1), b"")])) == invalid
        assert status_of(lambda: c.lookup([key(1)], lease_ttl_s=-1)) == invalid
        assert status_of(lambda: c.release("no-such-lease")) == grpc.StatusCode.NOT_FOUND
        assert status_of(lambda: c.put([(key(1), b"x" * (MiB + 1))])) == grpc.StatusCode.RESOURCE_EXHAUSTED

        with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.KVStoreStub(channel)

            def raw_put(*chunks: pb.BlockChunk) -> None:
                stub.Put(iter([pb.PutRequest(chunk=ch) for ch in chunks]), timeout=5)

            data = b"abcdefgh"
            good = checksum(data)
            assert status_of(lambda: raw_put(pb.BlockChunk(hash=key(2), total_size=8, checksum=good ^ 1, data=data))) == invalid
            first = pb.BlockChunk(hash=key(2), total_size=8, checksum=good, data=data[:4])
            assert status_of(lambda: raw_put(first, pb.BlockChunk(hash=key(2), offset=5, data=data[4:]))) == invalid
            assert status_of(lambda: raw_put(first)) == invalid  # stream ends mid-block
            assert status_of(lambda: raw_put(first, pb.BlockChunk(hash=key(3), offset=4, data=data[4:]))) == invalid
            unreserved = pb.BlockChunk(hash=key(2), total_size=8, checksum=good, shm_offset=0)
            assert status_of(lambda: stub.Put(iter([pb.PutRequest(staged=[unreserved])]), timeout=5)) == invalid
        assert c.get([key(1), key(2)]) == [None, None]  # nothing stored by any of it
        assert healthy(server)
        server.store.check_integrity()


def test_deadline_is_honoured_and_server_stays_healthy(tmp_path: Path) -> None:
    blocks = [(key(i), payload(i, 4 * MiB)) for i in range(8)]
    with running_server(tmp_path, host_capacity=64 * MiB) as server:
        with KVStoreClient(server.address, use_shm=False) as c:
            c.put(blocks)
        with KVStoreClient(server.address, timeout_s=0.001, use_shm=False) as hurried:
            assert status_of(lambda: hurried.get([k for k, _ in blocks])) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert healthy(server)


def test_leases_over_rpc_leave_nothing_pinned_after_a_burst(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        c.put([(key(i), payload(i)) for i in range(10)])
        released = c.lookup([key(i) for i in range(3)], lease_ttl_s=30)
        assert released.num_hits == 3 and released.lease_id
        c.release(released.lease_id)
        assert status_of(lambda: c.release(released.lease_id or "")) == grpc.StatusCode.NOT_FOUND

        def burst() -> None:
            for n in range(30):
                c.lookup([key(i) for i in range(n % 10)], lease_ttl_s=0.3)

        threads = [threading.Thread(target=burst) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert c.stats().pinned_blocks > 0
        time.sleep(0.5)  # TTL passes; the sweeper expires them with no further request needed
        assert server.store.stats().leases == 0
        assert (c.stats().leases, c.stats().pinned_blocks) == (0, 0)


ATTACKER = """
import sys
import grpc
from kvstore import KVStoreClient
from tests.kvstore_fixtures import key, payload
pinned, code = 0, None
with KVStoreClient(sys.argv[1]) as c:
    for i in range(32):
        c.put([(key(f"junk-{i}"), payload(f"junk-{i}", 65536))])
        try:
            assert c.lookup([key(f"junk-{i}")], lease_ttl_s=600).lease_id
        except grpc.RpcError as exc:
            code = exc.code().name
            break
        pinned += 65536
print(pinned, code)
"""


def test_same_host_callers_are_told_apart_by_process(tmp_path: Path) -> None:
    """On the arena's channel (a Lookup from the store's host), a caller is its process: one that pins up to its
    cap is refused as over gRPC, RESOURCE_EXHAUSTED, and another process's leases are counted apart."""
    config = StoreConfig(host_capacity=1 * MiB, shm_root=str(tmp_path), sweep_interval_s=0.05,
                         max_pinned_bytes_per_caller=MiB // 4)
    server = StoreServer(config, "127.0.0.1:0")
    addr = f"127.0.0.1:{server.start()}"
    try:
        attacker = subprocess.run([sys.executable, "-c", ATTACKER, addr], capture_output=True, text=True, cwd=REPO,
                                  timeout=120, check=True)
        assert attacker.stdout.split() == [str(MiB // 4), "RESOURCE_EXHAUSTED"]
        with KVStoreClient(addr) as victim:
            assert victim.arena_channel() is not None
            for i in range(16):
                assert victim.put([(key(f"real-{i}"), payload(f"real-{i}", 65536))]) == 1
                result = victim.lookup([key(f"real-{i}")], lease_ttl_s=30)
                assert result.num_hits == 1 and result.lease_id
                if i < 15:
                    victim.release(result.lease_id)
        callers = server.store.pinned_bytes_by_caller()
        assert callers[f"local-pid:{os.getpid()}"] == 65536
        assert [v for k, v in callers.items() if k != f"local-pid:{os.getpid()}"] == [MiB // 4]
        server.store.check_integrity()
    finally:
        server.stop(0.5)


def test_events_stream_stored_and_removed(tmp_path: Path) -> None:
    with running_server(tmp_path, host_capacity=200) as server, KVStoreClient(server.address) as c:
        events: list[tuple[bool, list[bytes]]] = []
        stream = c.watch_events()
        got_all = threading.Event()

        def listen() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                for ev in stream:
                    events.append((ev.kind == pb.Event.KIND_STORED, list(ev.hashes)))
                    if sum(len(h) for _, h in events) >= 4:
                        got_all.set()

        th = threading.Thread(target=listen, daemon=True)
        th.start()
        time.sleep(0.2)  # subscribed
        c.put([(key("a"), payload("a")), (key("b"), payload("b"))])
        c.put([(key("c"), payload("c"))])  # evicts b, the tail of the chain a-b (no disk tier)
        assert got_all.wait(5)
        stream.cancel()
        flat = [(stored, h) for stored, hs in events for h in hs]
        assert flat == [(True, key("a")), (True, key("b")), (False, key("b")), (True, key("c"))]


def test_corrupt_lmdb_value_is_detected_deleted_counted_and_a_miss(tmp_path: Path) -> None:
    config = dict(host_capacity=1000, disk_capacity=100_000, disk_path=tmp_path / "db")
    with running_server(tmp_path, **config) as server, KVStoreClient(server.address) as c:
        c.put([(key(i), payload(i)) for i in range(5)])
    corrupt_lmdb_value(tmp_path / "db", key(2))  # server stopped: everything was flushed to disk
    with running_server(tmp_path, **config) as server, KVStoreClient(server.address) as c:
        assert c.get([key(i) for i in range(5)]) == [payload(0), payload(1), None, payload(3), payload(4)]
        stats = c.stats()
        assert stats.checksum_failures == 1
        assert c.lookup([key(2)]).num_hits == 0


@pytest.mark.slow
def test_metrics_are_served(tmp_path: Path) -> None:
    with running_server(tmp_path) as server, KVStoreClient(server.address) as c:
        c.put([(key(1), payload(1))])
        c.get([key(1), key(2)])
    server = StoreServer(server.config, metrics_port=0)
    server.start()
    try:
        with KVStoreClient(server.address) as c:
            c.put([(key(1), payload(1))])
            c.lookup([key(1), key(2)], lease_ttl_s=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.rpc.bound_metrics_port}/metrics").read().decode()
    finally:
        server.stop(0.5)
    assert 'kvserve_kvstore_blocks{tier="host"} 1.0' in text
    assert 'kvserve_kvstore_hits_total{tier="host"} 1.0' in text
    assert "kvserve_kvstore_leases 1.0" in text
    for name in ("bytes", "misses_total", "evictions_total", "demotions_total", "promotions_total", "checksum_failures_total",
                 "disk_write_failures_total", "removed_blocks_total", "mac_failures_total"):
        assert f"kvserve_kvstore_{name}" in text
    assert 'kvserve_kvstore_tier_available{tier="host"} 1.0' in text


@pytest.mark.slow
def test_client_follows_a_restarted_store_to_its_new_shm_dir(tmp_path: Path) -> None:
    config = StoreConfig(shm_root=str(tmp_path), disk_capacity=1 * MiB, disk_path=tmp_path / "db")
    first = StoreServer(config)
    port = first.start()
    with KVStoreClient(f"127.0.0.1:{port}") as c:
        old_dir = c.shm_dir()
        assert c.put([(key(1), payload(1))]) == 1
        first.stop(0.5)  # flushes to disk, removes its shm dir
        second = StoreServer(config, f"127.0.0.1:{port}")
        second.start()
        try:
            assert c.put([(key(2), payload(2))]) == 1
            assert c.shm_dir() not in (None, old_dir)
            assert c.get([key(1), key(2)]) == [payload(1), payload(2)]
            assert c.put([(key(3), payload(3))]) == 1
        finally:
            second.stop(0.5)


def test_reflection_lists_the_store_and_health(tmp_path: Path) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with running_server(tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"kvserve.v1.KVStore", "grpc.health.v1.Health"} <= services
        assert db.FindFileContainingSymbol("kvserve.v1.KVStore").name == "protos/kvserve/v1/kvstore.proto"


@pytest.mark.parametrize("view", ["missing", "not-a-socket", "other-host"])
def test_client_not_sharing_the_arena_sends_bytes(tmp_path: Path, view: str) -> None:
    # As in a compose stack where containers share the boot id but not /dev/shm: the socket Info
    # names is absent or is not the store's, or the store runs on another machine.
    other = tmp_path / "client-view"
    other.write_text("")

    def seen_from_elsewhere(reply: pb.InfoResponse) -> None:
        if view == "other-host":
            reply.host_id = "another-machine"
        else:
            reply.arena_socket = str(tmp_path / "nowhere.sock") if view == "missing" else str(other)

    blocks = [(key(i), payload(i, 5000)) for i in range(4)]
    with running_server(tmp_path) as server, WireTap(server.address) as tap:
        tap.on_info = seen_from_elsewhere
        with KVStoreClient(tap.address) as c:
            assert c.shm_dir() is None
            assert c.put(blocks) == 4
            assert c.get([k for k, _ in blocks]) == [p for _, p in blocks]
    assert tap.put_requests and all(not r.staged and r.chunk.data for r in tap.put_requests)
    assert tap.get_requests and not any(r.via_shm for r in tap.get_requests)


def test_staged_puts_come_only_over_the_arena_socket_and_must_name_reserved_slots(tmp_path: Path) -> None:
    # Over gRPC, anyone who reaches the port could store what a freed arena slot still holds under any
    # hash: a staged block is refused there, whatever it names.
    with (running_server(tmp_path, host_capacity=1 * MiB) as server, KVStoreClient(server.address) as c,
          grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as grpc_channel):
        channel = c.arena_channel()
        assert channel is not None

        def reserve(sizes: list[int]) -> pb.ReserveResponse:
            request = pb.ReserveRequest(sizes=sizes).SerializeToString()
            return pb.ReserveResponse.FromString(channel.call(arena.RESERVE, request, 5.0))

        def refused(call: Callable[[], object]) -> str:
            with pytest.raises(arena.LocalCallError) as info:
                call()
            return info.value.status

        reply = reserve([3])
        named = pb.BlockChunk(hash=key(1), total_size=3, checksum=checksum(b"abc"), shm_offset=reply.offsets[0])
        stub = pb_grpc.KVStoreStub(grpc_channel)
        put = pb.PutRequest(staged=[named], reservation_id=reply.reservation_id)
        assert status_of(lambda: stub.Put(iter([put]), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        with_data = pb.BlockChunk(hash=key(1), total_size=3, checksum=checksum(b"abc"), data=b"abc")
        elsewhere = pb.BlockChunk(hash=key(1), total_size=3, checksum=checksum(b"abc"), shm_offset=reply.offsets[0] + 64)
        for request in (
            pb.PutRequest(staged=[with_data], reservation_id=reply.reservation_id),
            pb.PutRequest(chunk=with_data, staged=[named], reservation_id=reply.reservation_id),
            pb.PutRequest(staged=[named], reservation_id="someone-else"),
            pb.PutRequest(staged=[elsewhere], reservation_id=reply.reservation_id),
        ):
            assert refused(lambda r=request: channel.call(arena.PUT, r.SerializeToString(), 5.0)) == "INVALID_ARGUMENT"
        assert refused(lambda: reserve([])) == refused(lambda: reserve([0])) == "INVALID_ARGUMENT"
        assert refused(lambda: reserve([MiB // 4] * 3)) == "RESOURCE_EXHAUSTED"  # more than half the tier at once
        assert healthy(server) and len(server.store) == 0
        server.store.check_integrity()
        assert server.store.shm_tier.slots.slot_size(reply.offsets[0]) is None  # type: ignore[union-attr]


def test_same_host_puts_and_gets_go_over_the_arena_channel_not_grpc(tmp_path: Path) -> None:
    blocks = [(key(i), payload(i, 1 * MiB)) for i in range(10)]
    with (running_server(tmp_path, host_capacity=64 * MiB) as server, WireTap(server.address) as tap,
          KVStoreClient(tap.address) as c):
        assert c.put(blocks) == 10
        assert c.get([k for k, _ in blocks]) == [p for _, p in blocks]
        assert c.stats().tier("host").hits == 10
    assert not tap.put_requests and not tap.get_requests  # only Info and Stats crossed gRPC


def test_idle_events_streams_never_take_the_workers_that_serve_lookups(tmp_path: Path) -> None:
    # 32 idle Events streams used to hold all 32 workers: Lookup, Get and Stats then timed out.
    from kvstore.server import MAX_EVENT_STREAMS

    with running_server(tmp_path) as server, KVStoreClient(server.address, use_shm=False) as c:
        streams = [c.watch_events() for _ in range(MAX_EVENT_STREAMS)]
        try:
            wait_until(lambda: server.store.events.subscribers >= MAX_EVENT_STREAMS, interval_s=0.01,
                       message="the streams never all subscribed")  # as the server starts them
            c.put([(key(1), payload(1))])  # each open stream sees this event
            for stream in streams:
                assert next(stream).kind == pb.Event.KIND_STORED
            extra = c.watch_events()
            assert status_of(lambda: next(extra)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.lookup([key(1)]).num_hits == 1 and c.stats().tier("host").blocks == 1
        finally:
            for stream in streams:
                stream.cancel()
        wait_until(lambda: not server.store.events.subscribers, interval_s=0.01,  # a closed stream gives its place back
                   message="the cancelled streams kept their places")
        stream = c.watch_events()
        wait_until(lambda: server.store.events.subscribers, interval_s=0.01, message="the new stream never subscribed")
        c.put([(key(2), payload(2))])
        assert next(stream).kind == pb.Event.KIND_STORED
        stream.cancel()


def test_remove_over_rpc_drops_announces_and_lets_the_block_be_stored_again(tmp_path: Path) -> None:
    with running_server(tmp_path, host_capacity=1 * MiB) as server, KVStoreClient(server.address) as c:
        c.put([(key(1), payload(1)), (key(2), payload(2))])
        stream = c.watch_events()
        removed: list[bytes] = []
        seen = threading.Event()

        def listen() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                for ev in stream:
                    if ev.kind == pb.Event.KIND_REMOVED:
                        removed.extend(ev.hashes)
                        seen.set()

        threading.Thread(target=listen, daemon=True).start()
        time.sleep(0.2)  # subscribed
        assert c.remove([key(1), key(3)]) == 1 and c.remove([]) == 0
        assert seen.wait(5)
        stream.cancel()
        assert removed == [key(1)]
        assert c.get([key(1), key(2)]) == [None, payload(2)]
        assert c.stats().removed_blocks == 1
        assert c.put([(key(1), payload("recomputed"))]) == 1
        assert c.get([key(1)]) == [payload("recomputed")]
        assert status_of(lambda: c.remove([b"short"])) == grpc.StatusCode.INVALID_ARGUMENT
        server.store.check_integrity()


def test_max_block_bytes_and_the_longest_lease_are_enforced_over_rpc(tmp_path: Path) -> None:
    with running_server(tmp_path, host_capacity=1 * MiB, max_block_bytes=1000, max_lease_ttl_s=5) as server, \
            KVStoreClient(server.address, use_shm=False) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.put([(key(1), b"x" * 1001)])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "block of 1001 bytes exceeds the store's --max-block-bytes (1000 bytes)" in info.value.details()
        assert c.put([(key(1), b"x" * 1000)]) == 1
        result = c.lookup([key(1)], lease_ttl_s=600)
        assert result.lease_id and result.lease_ttl_s == 5  # granted, for the longest the store allows
        assert c.lookup([key(1)]).lease_ttl_s is None
        server.store.check_integrity()


def test_a_caller_pinning_junk_up_to_its_cap_cannot_stop_another_callers_puts(tmp_path: Path) -> None:
    """The attack: put junk, lease it for 600 s, again and again, until the tier is all pinned and
    everyone else's Puts are RESOURCE_EXHAUSTED. Over gRPC, callers are told apart by address: this one comes
    over IPv4, the legitimate one over IPv6 (a certificate's name, with mTLS). Both call by gRPC
    (use_shm=False), not on the arena's channel, where a caller is its process (the next test)."""
    config = StoreConfig(host_capacity=1 * MiB, shm_root=str(tmp_path), sweep_interval_s=0.05,
                         max_pinned_bytes_per_caller=MiB // 4)
    server = StoreServer(config, "[::]:0")
    try:
        port = server.start()
    except RuntimeError:
        pytest.skip("no IPv6 loopback here")
    block = 64 * 1024
    try:
        with KVStoreClient(f"127.0.0.1:{port}", use_shm=False) as attacker, \
                KVStoreClient(f"[::1]:{port}", use_shm=False) as victim:
            pinned, refused = 0, ""
            for i in range(32):  # twice what the tier holds
                attacker.put([(key(f"junk-{i}"), payload(f"junk-{i}", block))])
                try:
                    lease = attacker.lookup([key(f"junk-{i}")], lease_ttl_s=600)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    refused = exc.details()
                    break
                assert lease.lease_id
                pinned += block
            assert pinned == MiB // 4 and "--max-pinned-bytes-per-caller" in refused
            assert server.store.stats().pinned_blocks == 4
            for i in range(16):  # a tier's worth of legitimate blocks, each leased as prefill does
                assert victim.put([(key(f"real-{i}"), payload(f"real-{i}", block))]) == 1
                result = victim.lookup([key(f"real-{i}")], lease_ttl_s=30)
                assert result.num_hits == 1 and result.lease_id
                victim.release(result.lease_id)
            assert victim.get([key("real-15")]) == [payload("real-15", block)]
            server.store.check_integrity()
    finally:
        server.stop(0.5)


@pytest.mark.parametrize("use_shm", [False, True])
def test_a_put_hands_back_a_lease_on_its_blocks_stored_before_too(tmp_path: Path, use_shm: bool) -> None:
    """By gRPC and on the arena's channel: the put's lease pins every block it names, those a first write stored
    included (the arena path leaves them out of the put and names them to lease), and another put extends it."""
    with running_server(tmp_path) as server, KVStoreClient(server.address, use_shm=use_shm) as c:
        assert (c.arena_channel() is not None) == use_shm
        assert c.put([(key(0), payload(0))]) == 1
        first = c.put_leased([(key(i), payload(i)) for i in range(3)], 600)
        assert (first.num_new, first.lease_ttl_s) == (2, server.store.max_lease_ttl_s) and first.lease_id
        assert c.stats().pinned_blocks == 3
        again = c.put_leased([(key(i), payload(i)) for i in range(2)], 5, lease_id=first.lease_id)
        assert (again.num_new, again.lease_id) == (0, first.lease_id)
        more = c.put_leased([(key(3), payload(3))], 5, lease_id=first.lease_id)
        assert (more.num_new, more.lease_id, c.stats().pinned_blocks) == (1, first.lease_id, 4)
        assert c.put_leased([(key(4), payload(4))], None).lease_id is None
        c.release(first.lease_id)
        assert (c.stats().leases, c.stats().pinned_blocks) == (0, 0)
        assert c.put_leased([(key(5), payload(5))], 5, lease_id=first.lease_id).lease_id is None  # it ended
        server.store.check_integrity()


def test_stored_hashes_come_only_over_the_arena_socket(tmp_path: Path) -> None:
    """A gRPC stream of puts naming blocks stored before would grow without bound: INVALID_ARGUMENT."""
    with running_server(tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        requests = iter([pb.PutRequest(stored=[key(0)], lease_ttl_s=5)] * 3)
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.KVStoreStub(channel).Put(requests, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "arena socket" in refused.value.details()
