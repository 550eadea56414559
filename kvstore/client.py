"""KVStoreClient: the one way other packages reach the store.

Payloads are verified against their xxh3-64 checksums on receipt. A client on the same host as
the server opens the server's arena (kvstore/arena.py) and moves each block with one copy: out of
the slot the store names, into a slot it reserved for a put. Those calls go over the arena's Unix
socket (tens of microseconds a round trip, where gRPC takes half a millisecond), and no payload
crosses gRPC. Whatever it cannot move that way goes as chunked gRPC bytes, which remote clients
always use.

A store whose arena is its device tier (GPU memory, opened by CUDA IPC) is reached the same way; its
blocks are also had as tensors, device to device and a batch at a time (`get_tensors`, `put_tensors`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import grpc

from kvserve.rpc.server import CLIENT_CHANNEL_OPTIONS
from kvserve.rpc.tls import TLSConfig, channel
from kvstore.arena import GET as LOCAL_GET
from kvstore.arena import LOOKUP as LOCAL_LOOKUP
from kvstore.arena import PUT as LOCAL_PUT
from kvstore.arena import RESERVE as LOCAL_RESERVE
from kvstore.arena import LocalCallError, host_id, scatter
from kvstore.arena_map import ArenaMap, ChannelBusy
from kvstore.block_format import checksum
from kvstore.config import MAX_BLOCK_BYTES
from kvstore.types import (
    Buffer,
    Latency,
    LookupResult,
    Part,
    Payload,
    PutResult,
    RemoteStats,
    StoreStats,
    Tier,
    TierStats,
)
from kvstore.wire import BlockAssembler, split_block
from protos.block_hash import BlockHash
from protos.kvserve.v1 import kvstore_pb2 as pb
from protos.kvserve.v1 import kvstore_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvstore.device_tier import Device, OpenedSegment, Tensor



class StoreInfo(NamedTuple):
    host_id: str
    arena_socket: str  # "" when the server shares no arena
    max_message_bytes: int


class BlockEvent(NamedTuple):
    stored: bool  # False: removed
    hashes: list[BlockHash]
    tier: str | None


def _tier_name(value: int) -> str:
    return Tier(value).label if value else "unknown"


def _remote_stats(r: pb.RemoteStats) -> RemoteStats:
    breaker = pb.RemoteStats.Breaker.Name(r.breaker).removeprefix("BREAKER_").lower()
    return RemoteStats(r.url, breaker, r.hits, r.misses, r.read_errors, r.write_errors, r.checksum_failures,
                       r.mac_failures, r.read_bytes, r.written_blocks, r.written_bytes, r.dropped_writes,
                       r.queued_blocks, r.queued_bytes, Latency(r.read_calls, r.read_seconds),
                       Latency(r.write_calls, r.write_seconds))


class KVStoreClient:
    """Client of kvserve.v1.KVStore. Thread-safe; use as a context manager or call close().

    Errors are grpc.RpcError with code() and details(): gRPC's own, or LocalRpcError from the same-host channel
    (UNAVAILABLE / DEADLINE_EXCEEDED: the store is down or slow; INVALID_ARGUMENT, NOT_FOUND,
    RESOURCE_EXHAUSTED: see the message).
    """

    def __init__(self, addr: str, timeout_s: float = 5.0, *, use_shm: bool = True, tls: TLSConfig | None = None
                 ) -> None:
        """`use_shm=False` forces plain gRPC bytes even on the server's host. `tls`: TLS to the store,
        presenting its certificate (the store's arena socket takes only processes of its own user)."""
        self.addr = addr
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.checksum_failures = 0  # blocks received whose checksum did not match (reported as None)
        self._channel = channel(addr, CLIENT_CHANNEL_OPTIONS, tls)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._arena: ArenaMap | None = None
        self._arena_path = ""
        self._arena_checked = False
        self._arena_asking = False  # a thread is asking Info (arena_channel)
        self._closed = False
        self._arena_lock = threading.Lock()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._arena_lock:
            self._closed = True
            if self._arena is not None:
                self._arena.close()
                self._arena = None
        self._channel.close()

    # -- contract ------------------------------------------------------------------------------

    def put(self, blocks: Iterable[tuple[BlockHash, Payload]], ephemeral: bool = False) -> int:
        """Stores (hash, payload) pairs, in prefix order; returns how many were new. A payload may
        come in parts (a tuple of buffers, e.g. a header and a view of a KV pool slot): on the same
        host they are copied once, straight into the store's arena. A hash already stored keeps
        its payload (blocks are immutable: the first write wins)."""
        return self.put_leased(blocks, None, ephemeral=ephemeral).num_new

    def put_leased(self, blocks: Iterable[tuple[BlockHash, Payload]], lease_ttl_s: float | None, *,
                   lease_id: str | None = None, ephemeral: bool = False) -> PutResult:
        """`put`, and with `lease_ttl_s` a lease on every block put, new or stored before (a new lease, or
        `lease_id`'s, renewed), so that nothing evicts them before a reader has them. The lease is capped as a
        Lookup's is; past a cap, or where `lease_id` has ended, the blocks are stored and the result has no lease."""
        items = [(key, payload if isinstance(payload, tuple) else (payload,)) for key, payload in blocks]
        lease = pb.PutRequest(lease_ttl_s=lease_ttl_s or 0.0, lease_id=lease_id or "")
        arena = self.arena_channel()
        if arena is not None and items:
            try:
                return self._put_arena(arena, items, ephemeral, lease)
            except LocalCallError:
                pass  # refused (no room for a reservation, a bad block): the bytes go by gRPC, which says why
            except OSError:
                self._drop_arena(arena)
        return self._put_rpc(items, ephemeral, lease)

    def lookup(self, hashes: Sequence[BlockHash], lease_ttl_s: float | None = None) -> LookupResult:
        """How many leading hashes are present (and in which tier); pins them if lease_ttl_s (for at most the
        store's longest lease: the result says how long). RESOURCE_EXHAUSTED: this caller's leases pin
        as much as the store lets one caller pin; look up without a lease, or release some.

        On the same host the call goes over the arena's channel (a caller there is its process; a refusal is
        raised as gRPC's would be), else by gRPC."""
        request = pb.LookupRequest(hashes=list(hashes), lease_ttl_s=lease_ttl_s or 0.0)
        arena, response = self.arena_channel(), None
        if arena is not None and LOCAL_LOOKUP in arena.methods:
            try:
                response = pb.LookupResponse.FromString(self._arena_call(arena, LOCAL_LOOKUP, request.SerializeToString()))
            except LocalCallError as exc:
                raise LocalRpcError(exc.status, exc.message) from exc
            except OSError:
                self._drop_arena(arena)
        if response is None:
            response = self._stub.Lookup(request, timeout=self.timeout_s)
        tiers = [_tier_name(t) for t in response.tiers]
        return LookupResult(int(response.num_hits), tiers, response.lease_id or None,
                            float(response.lease_ttl_s) if response.lease_id else None)

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Verified payloads in request order; None for a miss or a corrupt block."""
        keys = list(hashes)
        out: list[bytes | None] = [None] * len(keys)

        def take(i: int, payload: Buffer) -> None:
            out[i] = bytes(payload)

        def take_shm(i: int, arena: ArenaMap, offset: int, size: int, csum: int) -> bool:
            out[i] = arena.segment.read(offset, size, csum)
            return out[i] is not None

        self._get(keys, take, take_shm)
        return out

    def get_into(self, hashes: Sequence[BlockHash], buffers: Sequence[Part | Sequence[Part]]
                 ) -> list[int | None]:
        """Like get, into caller buffers (one per hash, big enough, or a list or tuple of several filled in
        order, e.g. a header and a KV pool slot, which may copy the bytes in itself: kvstore.types.Sink): sizes written,
        None for a miss.

        The one-copy read path (docs/DESIGN.md, "Transfer"): on the same host each block is copied once,
        from its arena slot straight into the buffers."""
        keys = list(hashes)
        sizes: list[int | None] = [None] * len(keys)
        parts: list[list[Part]] = [list(b) if isinstance(b, (list, tuple)) else [cast("Part", b)] for b in buffers]

        def take(i: int, payload: Buffer) -> None:
            if scatter(payload, parts[i]):
                sizes[i] = len(payload)

        def take_shm(i: int, arena: ArenaMap, offset: int, size: int, csum: int) -> bool:
            ok = arena.segment.read_into(offset, size, csum, parts[i])
            sizes[i] = size if ok else None
            return ok

        self._get(keys, take, take_shm)
        return sizes

    def tensor_device(self) -> Device | None:
        """The device of the store's device arena when this client has opened it (same node), else None:
        then `get_tensors` and `put_tensors` move blocks device to device."""
        opened = self._device_arena()
        return None if opened is None else opened[1].device

    def get_tensors(self, hashes: Sequence[BlockHash]) -> list[Tensor | None]:
        """Verified payloads as flat uint8 tensors, in request order; None for a miss or a corrupt block.
        Blocks in the store's device arena are copied out of it on the device, one batch per block size
        (checksummed there); the rest come as `get`'s bytes, in CPU tensors."""
        from kvstore.device_tier import host_tensor

        keys = list(hashes)
        out: list[Tensor | None] = [None] * len(keys)
        opened = self._device_arena()
        if opened is None:
            return [None if p is None else host_tensor(p) for p in self.get(keys)]
        arena, segment = opened
        todo = list(range(len(keys)))
        try:
            slots = self._locate(arena, keys)
            found = [i for i, s in enumerate(slots) if s.HasField("shm_offset")]
            got = segment.read_many([slots[i].shm_offset for i in found], [slots[i].total_size for i in found],
                                    [slots[i].checksum for i in found])
            for i, tensor in zip(found, got, strict=True):
                out[i] = tensor
            todo = [i for i, t in enumerate(out) if t is None]
        except LocalCallError:
            pass
        except (OSError, RuntimeError):  # the channel broke, the arena closed, a device copy failed
            self._drop_arena(arena)

        def take(i: int, payload: Buffer) -> None:
            out[i] = host_tensor(payload)

        if todo:
            self._get_rpc(keys, todo, None, take, lambda *_: False)
        return out

    def put_tensors(self, blocks: Iterable[tuple[BlockHash, Sequence[Tensor | Buffer]]],
                    ephemeral: bool = False) -> int:
        """Stores blocks given in parts (bytes, or tensors viewed as bytes: e.g. a header and a KV pool slot);
        returns how many were new. Into the store's device arena they are copied on the device, a batch
        per size; anywhere else they go as `put`'s bytes (tensors copied to the host first)."""
        return self.put_tensors_leased(blocks, None, ephemeral=ephemeral).num_new

    def put_tensors_leased(self, blocks: Iterable[tuple[BlockHash, Sequence[Tensor | Buffer]]],
                           lease_ttl_s: float | None, *, lease_id: str | None = None, ephemeral: bool = False
                           ) -> PutResult:
        """`put_tensors`, leasing the blocks as `put_leased` does."""
        items = [(key, tuple(parts)) for key, parts in blocks]
        opened = self._device_arena()
        if opened is not None and items:
            lease = pb.PutRequest(lease_ttl_s=lease_ttl_s or 0.0, lease_id=lease_id or "")
            try:
                return self._put_arena(opened[0], items, ephemeral, lease)  # type: ignore[arg-type]
            except LocalCallError:
                pass
            except (OSError, RuntimeError):  # dropping the channel ends its reservations in the store
                self._drop_arena(opened[0])
        return self.put_leased([(key, tuple(_host_bytes(p) for p in parts)) for key, parts in items], lease_ttl_s,
                               lease_id=lease_id, ephemeral=ephemeral)

    def release(self, lease_id: str) -> None:
        self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self.timeout_s)

    def remove(self, hashes: Sequence[BlockHash]) -> int:
        """Drops blocks that a reader found bad (corrupt, of another model or shape, non-finite values) from
        every tier, so that the reader's recomputed blocks can be put in their place; returns how many
        were stored. An internal call: blocks are otherwise immutable."""
        if not hashes:
            return 0
        return int(self._stub.Remove(pb.RemoveRequest(hashes=list(hashes)), timeout=self.timeout_s).num_removed)

    def stats(self) -> StoreStats:
        r = self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        tiers = [
            TierStats(_tier_name(t.tier), t.blocks, t.bytes, t.capacity_bytes, t.hits, t.misses, t.evictions, t.demotions, t.promotions,
                      available=not t.unavailable)
            for t in r.tiers
        ]
        return StoreStats(tiers, int(r.leases), int(r.pinned_blocks), int(r.checksum_failures),
                          int(r.disk_write_failures), int(r.removed_blocks),
                          _remote_stats(r.remote) if r.HasField("remote") else None, int(r.mac_failures))

    # -- extras --------------------------------------------------------------------------------

    def info(self) -> StoreInfo:
        r = self._stub.Info(pb.InfoRequest(), timeout=self.timeout_s)
        return StoreInfo(r.host_id, r.arena_socket, int(r.max_message_bytes))

    def events(self) -> Iterator[BlockEvent]:
        """Blocks stored and removed, as they happen (no deadline; cancel by closing the client)."""
        for ev in self._stub.Events(pb.EventsRequest()):
            yield BlockEvent(ev.kind == pb.Event.KIND_STORED, list(ev.hashes), _tier_name(ev.tier) if ev.tier else None)

    def watch_events(self) -> Any:
        """The Events call itself, for a relay: iterate it for `pb.Event`s, `cancel()` it when done."""
        return self._stub.Events(pb.EventsRequest())

    def shm_dir(self) -> Path | None:
        """The server's shared-memory dir when this client maps its arena, else None."""
        return Path(self._arena_path).parent if self.arena_channel() is not None else None

    @property
    def open_arena(self) -> ArenaMap | None:
        """The channel to the store's arena open now, without asking for one (None: none is open)."""
        return self._arena

    def arena_channel(self) -> ArenaMap | None:
        """The channel to the store's arena, opened when not yet (None: the store is on another host, has no
        arena, or `use_shm` is off): puts, lookups and gets go over it, their bytes through the arena."""
        # Asks Info once, and again whenever the socket has gone (the server restarted elsewhere). One thread asks
        # at a time, outside the lock: the calls meanwhile go by gRPC, each bounded by its own timeout, instead of
        # waiting in turn for a store that does not answer.
        if not self.use_shm:
            return None
        with self._arena_lock:
            if self._arena_checked and (self._arena is None or Path(self._arena_path).exists()):
                return self._arena
            if self._arena_asking or self._closed:
                return None
            self._arena_asking, stale, self._arena, self._arena_checked = True, self._arena, None, False
        try:
            if stale is not None:
                stale.close()
            try:
                info = self.info()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                    raise
                info = StoreInfo("", "", 0)
            opened = None
            if info.arena_socket and info.host_id == host_id():
                with contextlib.suppress(OSError):  # another container, or not a kvserve arena: bytes it is
                    opened = ArenaMap(info.arena_socket, self.timeout_s)
            with self._arena_lock:
                if not self._closed:
                    self._arena, self._arena_path, self._arena_checked = opened, info.arena_socket, True
                    return opened
            if opened is not None:
                opened.close()
            return None
        finally:
            with self._arena_lock:
                self._arena_asking = False

    # -- internals -----------------------------------------------------------------------------

    def _device_arena(self) -> tuple[ArenaMap, OpenedSegment] | None:
        """The store's arena and its segment when it is a device arena this client opened."""
        arena = self.arena_channel()
        if arena is None or not hasattr(arena.segment, "read_many"):
            return None
        return arena, arena.segment  # type: ignore[return-value]

    def _locate(self, arena: ArenaMap, keys: list[BlockHash]) -> list[pb.BlockChunk]:
        """Where the store's arena holds each block (a slot with shm_offset set), on its same-host channel."""
        reply = pb.GetResponse.FromString(self._arena_call(arena, LOCAL_GET, pb.GetRequest(hashes=keys).SerializeToString()))
        slots = list(reply.slots)
        if len(slots) != len(keys) or any(s.hash != k for s, k in zip(slots, keys, strict=True)):
            raise ValueError("the store's arena channel answered other blocks than asked")
        return slots

    def _arena_call(self, arena: ArenaMap, method: int, body: bytes) -> bytes:
        """A call on the arena's channel. A store that does not answer in time is DEADLINE_EXCEEDED at once and the
        channel is dropped: asking again by gRPC would wait as long once more (LocalCallError and OSError are
        the caller's)."""
        try:
            return arena.call(method, body, self.timeout_s)
        except TimeoutError as exc:
            if not isinstance(exc, ChannelBusy):
                self._drop_arena(arena)
            raise LocalRpcError("DEADLINE_EXCEEDED", f"the store did not answer on its arena channel within "
                                                     f"{self.timeout_s:g} s") from exc

    def _drop_arena(self, arena: ArenaMap) -> None:
        # Its channel broke (the store restarted or went away): ask Info again next time.
        with self._arena_lock:
            if self._arena is arena:
                self._arena, self._arena_checked = None, False
        arena.close()

    def _get(self, keys: list[BlockHash], take: Callable[[int, Buffer], None],
             take_shm: Callable[[int, ArenaMap, int, int, int], bool]) -> None:
        """Same host: one call on the arena's channel names the slots, each block is copied out of its own;
        what is not in the arena (or failed its checksum) goes by gRPC."""
        arena = self.arena_channel()
        todo = list(range(len(keys)))
        if arena is not None and keys:
            try:
                slots = self._locate(arena, keys)
                todo = [i for i, s in enumerate(slots)
                        if not (s.HasField("shm_offset") and take_shm(i, arena, s.shm_offset, s.total_size, s.checksum))]
            except LocalCallError:
                pass
            except OSError:
                self._drop_arena(arena)
                arena = None
        if todo:
            self._get_rpc(keys, todo, arena, take, take_shm)

    def _put_arena(self, arena: ArenaMap, items: list[tuple[BlockHash, tuple[Buffer, ...]]], ephemeral: bool,
                   lease: pb.PutRequest) -> PutResult:
        """`lease`: a PutRequest with only the lease's fields set (lease_ttl_s 0: none)."""
        sizes = [sum(_nbytes(part) for part in parts) for _, parts in items]
        request = pb.ReserveRequest(sizes=sizes, hashes=[key for key, _ in items])
        reply = pb.ReserveResponse.FromString(self._arena_call(arena, LOCAL_RESERVE, request.SerializeToString()))
        if not len(reply.offsets) == len(reply.stored) == len(items):
            raise ValueError(f"store reserved {len(reply.offsets)} slots for {len(items)} blocks")
        stored = [items[i][0] for i, s in enumerate(reply.stored) if s]
        if all(reply.stored) and not lease.lease_ttl_s:
            return PutResult(0)  # every block is stored already: nothing to copy
        new = [i for i, s in enumerate(reply.stored) if not s]
        offsets = [reply.offsets[i] for i in new]
        checksums = arena.segment.write_many(offsets, [items[i][1] for i in new])
        staged = [pb.BlockChunk(hash=items[i][0], total_size=sizes[i], checksum=csum, shm_offset=offset)
                  for i, offset, csum in zip(new, offsets, checksums, strict=True)]
        put = pb.PutRequest(staged=staged, ephemeral=ephemeral, reservation_id=reply.reservation_id)
        if lease.lease_ttl_s:  # the stored blocks are leased with the staged ones (alone, if there are none)
            put.MergeFrom(lease)
            put.stored.extend(stored)
        return _put_result(pb.PutResponse.FromString(self._arena_call(arena, LOCAL_PUT, put.SerializeToString())))

    def _put_rpc(self, items: list[tuple[BlockHash, tuple[Buffer, ...]]], ephemeral: bool, lease: pb.PutRequest
                 ) -> PutResult:
        def requests() -> Iterator[pb.PutRequest]:
            first = True
            for key, parts in items:
                payload = parts[0] if len(parts) == 1 else b"".join(parts)
                for chunk in split_block(key, payload, checksum(payload)):
                    request = pb.PutRequest(chunk=chunk, ephemeral=ephemeral)
                    if first:  # the lease is asked for once, on the first request
                        request.MergeFrom(lease)
                        first = False
                    yield request

        return _put_result(self._stub.Put(requests(), timeout=self.timeout_s))

    def _get_rpc(self, keys: list[BlockHash], todo: list[int], arena: ArenaMap | None,
                 take: Callable[[int, Buffer], None], take_shm: Callable[[int, ArenaMap, int, int, int], bool]) -> None:
        # A block the store answers is bounded as one it would take: no answer makes this process buffer more.
        assembler = BlockAssembler(MAX_BLOCK_BYTES, "the most a store holds in one block")
        retry: list[int] = []
        pending = iter(todo)
        request = pb.GetRequest(hashes=[keys[i] for i in todo], via_shm=arena is not None)
        for response in self._stub.Get(request, timeout=self.timeout_s):
            for slot in response.slots:
                i = next(pending)
                if slot.hash != keys[i]:
                    raise ValueError(f"store answered block {slot.hash.hex()[:16]} for {keys[i].hex()[:16]}")
                if slot.HasField("shm_offset") and (
                        arena is None or not take_shm(i, arena, slot.shm_offset, slot.total_size, slot.checksum)):
                    retry.append(i)  # its slot was reused between the answer and the copy: ask for bytes
            if response.slots:
                continue
            if not response.found:
                next(pending)
                continue
            block = assembler.feed(response.chunk)
            if block is None:
                continue
            i = next(pending)
            if block.key != keys[i]:
                raise ValueError(f"store answered block {block.key.hex()[:16]} for {keys[i].hex()[:16]}")
            if block.shm_offset is not None:
                if arena is None or not take_shm(i, arena, block.shm_offset, block.total_size, block.checksum):
                    retry.append(i)  # its slot was reused between the answer and the copy: ask for bytes
            elif block.payload is not None and checksum(block.payload) == block.checksum:
                take(i, block.payload)
            else:
                self.checksum_failures += 1
        assembler.finish()
        if retry:
            self._get_rpc(keys, retry, None, take, take_shm)


class LocalRpcError(grpc.RpcError):
    """A call on the store's same-host channel that the store refused (or did not answer in time), raised as gRPC
    raises a status: ``code()``, ``details()``."""

    def __init__(self, status: str, details: str) -> None:
        super().__init__(f"{status}: {details}")
        self._code = getattr(grpc.StatusCode, status, grpc.StatusCode.UNKNOWN)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _put_result(response: pb.PutResponse) -> PutResult:
    return PutResult(int(response.num_new), response.lease_id or None,
                     float(response.lease_ttl_s) if response.lease_id else None)


def _nbytes(part: Any) -> int:
    """Bytes of a buffer or a tensor (whose len() counts its first dimension)."""
    return int(part.nbytes) if hasattr(part, "nbytes") else len(part)


def _host_bytes(part: Any) -> Buffer:
    """A part as host bytes: a tensor is copied off its device, flat."""
    if isinstance(part, bytes | bytearray | memoryview):
        return part
    from kvstore.device_tier import as_uint8

    return as_uint8(part).cpu().numpy().data
