"""The KVStore gRPC servicer (thin: protobuf <-> BlockStore) and the server that hosts it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import cast
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry

from kvserve.rpc.server import MAX_MESSAGE_BYTES, Server
from kvserve.rpc.tls import TLSConfig
from kvstore import arena
from kvstore.arena import host_id
from kvstore.build import build_remote, build_tiers, pinned_bytes_cap
from kvstore.config import StoreConfig
from kvstore.errors import InvalidRequest, StoreFull
from kvstore.events import StoreEvent
from kvstore.metrics import StoreCollector
from kvstore.store import BlockStore, FlushResult
from kvstore.types import RemoteStats, Tier
from kvstore.wire import BlockAssembler, split_block
from protos.block_hash import BlockHash
from protos.kvserve.v1 import kvstore_pb2 as pb
from protos.kvserve.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "kvserve.v1.KVStore"
# Of the server's 256 workers (a stream holds one while it lasts): the rest always serve Lookup, Get and Put. Each
# router relays each decode replica's events through one: 4 decode replicas on a node behind 2 routers take 8,
# and a rollout's surge more.
MAX_EVENT_STREAMS = 32


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, *, event_poll_s: float = 0.25,
                 max_event_streams: int = MAX_EVENT_STREAMS) -> None:
        self.store = store
        self.host_id = host_id()
        self.event_poll_s = event_poll_s
        self._event_streams = threading.BoundedSemaphore(max_event_streams)
        self.max_event_streams = max_event_streams

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        return self._lookup(request, caller_of(context))

    def _lookup(self, request: pb.LookupRequest, caller: str | None) -> pb.LookupResponse:
        result = self.store.lookup(list(request.hashes), request.lease_ttl_s or None, caller=caller)
        tiers = [_pb_tier(t) for t in result.tiers]
        return pb.LookupResponse(num_hits=result.num_hits, tiers=tiers, lease_id=result.lease_id or "",
                                 lease_ttl_s=result.lease_ttl_s or 0.0)

    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.RemoveResponse:
        return pb.RemoveResponse(num_removed=self.store.remove(list(request.hashes)))

    def Put(self, request_iterator: Iterable[pb.PutRequest], context: grpc.ServicerContext) -> pb.PutResponse:
        return self._put(request_iterator, staged=False, caller=caller_of(context))

    def _put(self, request_iterator: Iterable[pb.PutRequest], *, staged: bool, caller: str | None) -> pb.PutResponse:
        # Staged blocks (arena slots) come only over the arena socket, from the store's user on its host:
        # over the network they would let anyone store what a freed slot still holds under any hash.
        assembler = BlockAssembler(self.store.max_block_bytes, self.store.block_limit)
        keys: list[BlockHash] = []
        num_new = 0
        ephemeral = False
        reservations: set[str] = set()
        stored: list[BlockHash] = []  # left out as stored already: leased with the put
        lease_ttl_s, lease_id = 0.0, ""
        try:
            for request in request_iterator:
                if request.lease_ttl_s and not lease_ttl_s:  # checked before any block of the put is stored
                    lease_ttl_s, lease_id = self.store.lease_ttl(request.lease_ttl_s) or 0.0, request.lease_id
                if request.stored and not staged:  # one arena message is bounded; a gRPC stream is not
                    raise InvalidRequest("stored hashes come with staged puts over the arena socket, not gRPC")
                stored.extend(request.stored)
                for chunk in _chunks_of(request):
                    if not assembler.in_block:
                        ephemeral = request.ephemeral
                    block = assembler.feed(chunk)
                    if block is None:
                        continue
                    if block.shm_offset is not None:
                        if not staged:
                            raise InvalidRequest("staged blocks (shm_offset) are put over the arena socket, not gRPC")
                        reservations.add(request.reservation_id)
                        added = self.store.put_reserved(block.key, request.reservation_id, block.shm_offset,
                                                        block.total_size, block.checksum, ephemeral=ephemeral)
                    else:
                        assert block.payload is not None
                        added = self.store.put(block.key, block.payload, block.checksum, ephemeral=ephemeral)
                    num_new += added
                    keys.append(block.key)
            assembler.finish()
        finally:
            for rid in reservations:  # slots reserved and not put go back at once
                self.store.end_reservation(rid)
        if not keys and not stored:
            raise InvalidRequest("empty put: the stream carried no blocks")
        self.store.touch(keys)
        leased, ttl = self.store.lease_stored([*stored, *keys], lease_ttl_s, caller=caller, lease_id=lease_id or None)
        return pb.PutResponse(num_new=num_new, num_existing=len(keys) - num_new, lease_id=leased or "",
                              lease_ttl_s=ttl or 0.0)

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:
        keys = list(request.hashes)
        slots: list[pb.BlockChunk] = []  # same-host answers, sent together
        for key, read in zip(keys, self.store.get(keys, via_shm=request.via_shm), strict=True):
            if not context.is_active():
                return  # cancelled or past its deadline: stop reading
            if request.via_shm and (read is None or read.shm_offset is not None):
                offset = None if read is None else read.shm_offset
                slots.append(pb.BlockChunk(hash=key, total_size=read.size, checksum=read.checksum, shm_offset=offset)
                             if read is not None else pb.BlockChunk(hash=key))
                continue
            if slots:
                yield pb.GetResponse(slots=slots)
                slots = []
            if read is None:
                yield pb.GetResponse(chunk=pb.BlockChunk(hash=key), found=False)
            else:
                assert read.payload is not None
                for chunk in split_block(key, read.payload, read.checksum):
                    yield pb.GetResponse(chunk=chunk, found=True, tier=_pb_tier(read.tier))
        if slots:
            yield pb.GetResponse(slots=slots)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        self.store.release(request.lease_id)
        return pb.ReleaseResponse()

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        stats = self.store.stats()
        tiers = [
            pb.TierStats(
                tier=_pb_tier(t.tier), blocks=t.blocks, bytes=t.bytes,
                capacity_bytes=t.capacity_bytes, hits=t.hits, misses=t.misses, evictions=t.evictions,
                demotions=t.demotions, promotions=t.promotions, unavailable=not t.available,
            )
            for t in stats.tiers
        ]
        return pb.StatsResponse(
            tiers=tiers, leases=stats.leases, pinned_blocks=stats.pinned_blocks,
            checksum_failures=stats.checksum_failures, disk_write_failures=stats.disk_write_failures,
            removed_blocks=stats.removed_blocks, remote=_pb_remote(stats.remote), mac_failures=stats.mac_failures,
        )

    def Events(self, request: pb.EventsRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        """Stored/removed hashes, batched by runs of one kind and tier. A slow subscriber loses
        its oldest events (bounded queue), it is never disconnected and never slows the store."""
        # Each stream holds a server worker for as long as it is open: a few, never all of them.
        if not self._event_streams.acquire(blocking=False):
            raise StoreFull(f"{self.max_event_streams} Events streams are open already, the most this store "
                            "serves: close one, or share one stream among your routers")
        sub = self.store.events.subscribe()
        context.add_callback(sub.close)
        try:
            while context.is_active() and not sub.closed:
                for kind, tier, keys in _runs(sub.take(self.event_poll_s)):
                    yield pb.Event(kind=kind, hashes=keys, tier=tier)
        finally:
            sub.close()
            self._event_streams.release()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        shm = self.store.shm_tier
        return pb.InfoResponse(
            host_id=self.host_id, arena_socket=str(shm.socket.path) if shm else "", max_message_bytes=MAX_MESSAGE_BYTES,
        )

    def handle_local(self, method: int, body: bytes, peer: arena.Connection) -> bytes:
        """A call on the arena's same-host channel (kvstore/arena.py): the same messages as the RPCs; one that
        does not parse is INVALID_ARGUMENT, as gRPC would answer it."""
        try:
            return self._handle_local(method, body, peer)
        except DecodeError as exc:
            raise InvalidRequest(f"a malformed message for method {method} on the arena socket: {exc}") from exc

    def _handle_local(self, method: int, body: bytes, peer: arena.Connection) -> bytes:
        reservations = peer.reservations
        if method == arena.LOOKUP:
            return self._lookup(pb.LookupRequest.FromString(body), peer.caller).SerializeToString()
        if method == arena.GET:
            keys = list(pb.GetRequest.FromString(body).hashes)
            slots = [pb.BlockChunk(hash=key, shm_offset=f[0], total_size=f[1], checksum=f[2]) if f else pb.BlockChunk(hash=key)
                     for key, f in zip(keys, self.store.locate(keys), strict=True)]
            return pb.GetResponse(slots=slots).SerializeToString()
        if method == arena.RESERVE:
            request = pb.ReserveRequest.FromString(body)
            rid, offsets = self.store.reserve(list(request.sizes), list(request.hashes))
            if rid:
                reservations.add(rid)
            return pb.ReserveResponse(reservation_id=rid, offsets=[o or 0 for o in offsets],
                                      stored=[o is None for o in offsets] if request.hashes else []).SerializeToString()
        if method == arena.PUT:
            request = pb.PutRequest.FromString(body)
            reservations.discard(request.reservation_id)  # the put ends it
            return self._put([request], staged=True, caller=peer.caller).SerializeToString()
        if method == arena.END_RESERVATIONS:  # the connection closed
            for rid in reservations:
                self.store.end_reservation(rid)
            return b""
        raise InvalidRequest(f"no method {method} on the arena socket")



def caller_of(context: grpc.ServicerContext) -> str | None:
    """Who calls, for the per-caller limits: the identity in its certificate when TLS is on (common name,
    else the first subject alternative name), else its address without the port (every process of a
    host is one caller). None where the context cannot say (tests without a server)."""
    try:
        auth = context.auth_context() or {}
        peer = context.peer()
    except NotImplementedError:
        return None
    for prop in ("x509_common_name", "x509_subject_alternative_name"):
        names = auth.get(prop)
        if names:
            return "cert:" + names[0].decode(errors="replace")
    kind, _, address = unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0].strip("[]")  # "ipv4:10.0.0.7:port" -> "10.0.0.7", "ipv6:[::1]:port" -> "::1"
    return peer  # "unix:..." and the like: the whole of it


def _chunks_of(request: pb.PutRequest) -> list[pb.BlockChunk]:
    if not request.staged:
        return [] if request.stored and not request.HasField("chunk") else [request.chunk]
    if request.HasField("chunk") or any(not c.HasField("shm_offset") for c in request.staged):
        raise InvalidRequest("a put request carries either one chunk or staged blocks (each with shm_offset)")
    return list(request.staged)


def _pb_remote(remote: RemoteStats | None) -> pb.RemoteStats | None:
    if remote is None:
        return None
    r = remote
    return pb.RemoteStats(
        url=r.url, breaker=cast(pb.RemoteStats.Breaker, pb.RemoteStats.Breaker.Value("BREAKER_" + r.breaker.upper())),
        hits=r.hits, misses=r.misses, read_errors=r.read_errors, write_errors=r.write_errors,
        checksum_failures=r.checksum_failures, mac_failures=r.mac_failures, read_bytes=r.read_bytes, written_blocks=r.written_blocks,
        written_bytes=r.written_bytes, dropped_writes=r.dropped_writes, queued_blocks=r.queued_blocks,
        queued_bytes=r.queued_bytes, read_calls=r.read_latency.calls, read_seconds=r.read_latency.seconds,
        write_calls=r.write_latency.calls, write_seconds=r.write_latency.seconds,
    )


def _pb_tier(tier: Tier | str | None) -> pb.Tier:
    if tier is None:
        return cast(pb.Tier, 0)
    return cast(pb.Tier, int(Tier[tier.upper()] if isinstance(tier, str) else tier))


def _runs(events: list[StoreEvent]) -> Iterator[tuple[pb.Event.Kind, pb.Tier, list[bytes]]]:
    run: list[bytes] = []
    current: tuple[pb.Event.Kind, pb.Tier] | None = None
    for ev in events:
        key = (pb.Event.KIND_STORED if ev.stored else pb.Event.KIND_REMOVED, _pb_tier(ev.tier))
        if key != current and run:
            assert current is not None
            yield (*current, run)
            run = []
        current = key
        run.append(ev.key)
    if run and current is not None:
        yield (*current, run)


class StoreServer:
    """A BlockStore behind gRPC (with health, reflection, metrics) and a lease sweeper."""

    def __init__(self, config: StoreConfig, listen: str = "127.0.0.1:0", *, metrics_port: int | None = None,
                 tls: TLSConfig | None = None, health_listen: str | None = None) -> None:
        self.config = config
        tiers = build_tiers(config)
        self.store = BlockStore(tiers, max_block_bytes=config.max_block_bytes, max_lease_ttl_s=config.max_lease_ttl_s,
                                max_pinned_bytes_per_caller=pinned_bytes_cap(config, tiers),
                                remote=build_remote(config))
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(self.store))
        # An internal server: with a CA, only callers with a certificate from it.
        # Every prefill and decode stream of the node calls it; a call past the limit would be a miss, recomputed.
        self.rpc = Server(listen, max_workers=256, metrics_port=metrics_port, registry=self.registry, tls=tls,
                          name="kvstore", health_listen=health_listen)
        servicer = KVStoreServicer(self.store)
        self.rpc.add(pb_grpc.add_KVStoreServicer_to_server, servicer, SERVICE_NAME)
        if self.store.shm_tier is not None:
            self.store.shm_tier.socket.handler = servicer.handle_local
        self._stop_sweeper = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvstore-lease-sweeper", daemon=True)
        self._closed = False
        self.flush_result: FlushResult | None = None

    @property
    def port(self) -> int:
        return self.rpc.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc.port}"

    def start(self) -> int:
        self.start_sweeper()
        return self.rpc.start()

    def start_sweeper(self) -> None:
        """Expires leases every `sweep_interval_s`, so that an idle store holds no pin past its TTL
        (`start` does it; a caller that starts `rpc` itself, as `python -m kvstore` does, calls this)."""
        self._sweeper.start()

    def stop(self, grace_s: float = 2.0) -> FlushResult | None:
        """Stops serving, flushes the memory tiers to disk and closes the store."""
        self.store.events.close()  # ends Events streams at once
        self.rpc.stop(grace_s)
        self.close_store()
        return self.flush_result

    def close_store(self) -> None:
        """Flushes the memory tiers to disk (bounded by flush_timeout_s) and closes every tier."""
        if self._closed:
            return
        self._closed = True
        self._stop_sweeper.set()
        deadline = time.monotonic() + self.config.flush_timeout_s
        self.flush_result = self.store.flush_to_disk(self.config.flush_timeout_s)
        disk = next((s.storage for s in self.store.tiers if s.tier == Tier.DISK), None)
        if disk is not None and disk.failure is not None:
            log.warning("flushed %d blocks to disk (%d left in memory, durable=%s): the disk tier failed at runtime "
                        "(%s) and dropped %d block writes", *self.flush_result, disk.failure,
                        self.store.stats().disk_write_failures)
        else:
            log.info("flushed %d blocks to disk (%d left in memory, durable=%s)", *self.flush_result)
        self.store.close(timeout_s=max(1.0, deadline - time.monotonic()))

    def __enter__(self) -> StoreServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _sweep_loop(self) -> None:
        while not self._stop_sweeper.wait(self.config.sweep_interval_s):
            self.store.sweep()
