"""KVStoreClient: the one way other packages reach the store.

Payloads are verified against their xxh3-64 checksums on receipt. A client on the same host as
the server (same boot id, shm dir accessible) reads blocks of the host tier straight from shared
memory and stages puts there, so no payload crosses gRPC; everything it cannot read that way
falls back to the plain chunked gRPC path, which remote clients always use.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import grpc

from kvstore.block_format import checksum
from kvstore.shm import ShmReader, host_id, stage_block_file, usable_dir
from kvstore.types import LookupResult, StoreStats, Tier, TierStats
from kvstore.wire import BlockAssembler, split_block
from protos.block_hash import BlockHash
from protos.kvserve.v1 import kvstore_pb2 as pb
from protos.kvserve.v1 import kvstore_pb2_grpc as pb_grpc
from serving.server import CHANNEL_OPTIONS

_NO_LIMIT = 1 << 62
_REPORT_INTERVAL_S = 0.05
_REPORT_KEYS = 4096
_STAGED_BATCH_BYTES = 4 << 20  # same-host put: staged blocks named per message


class StoreInfo(NamedTuple):
    host_id: str
    shm_dir: str
    max_message_bytes: int
    shm_token: str = ""


class BlockEvent(NamedTuple):
    stored: bool  # False: removed
    hashes: list[BlockHash]
    tier: str | None


def _tier_name(value: int) -> str:
    return Tier(value).label if value else "unknown"


class KVStoreClient:
    """Client of kvserve.v1.KVStore. Thread-safe; use as a context manager or call close().

    Errors are the grpc.RpcError that grpc raises (UNAVAILABLE / DEADLINE_EXCEEDED: the store is
    down or slow; INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED: see the message).
    """

    def __init__(
        self, addr: str, timeout_s: float = 5.0, *, use_shm: bool = True, shm_map_bytes: int = 1 << 30
    ) -> None:
        """`use_shm=False` forces plain gRPC bytes; `shm_map_bytes` bounds the shared-memory
        mappings this client keeps open (they may outlive blocks the server evicted)."""
        self.addr = addr
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.shm_map_bytes = shm_map_bytes
        self.checksum_failures = 0  # blocks received whose checksum did not match (reported as None)
        self._channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._reader: ShmReader | None = None
        self._shm_checked = False
        self._shm_lock = threading.Lock()
        self._report: grpc.Future | None = None
        self._unreported: list[BlockHash] = []
        self._reported_at = 0.0
        self._reports_lock = threading.Lock()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._report_reads([], now=True)
        if self._reader is not None:
            self._reader.close()
        self._channel.close()

    # -- contract ------------------------------------------------------------------------------

    def put(self, blocks: Iterable[tuple[BlockHash, bytes]], ephemeral: bool = False) -> int:
        """Stores (hash, payload) pairs, in prefix order; returns how many were new. A hash
        already stored keeps its payload (blocks are immutable: the first write wins)."""
        reader = self._shm()
        shm = None if reader is None else Path(reader.dir)
        staged: list[Path] = []

        def requests() -> Iterator[pb.PutRequest]:
            nonlocal shm
            batch: list[pb.BlockChunk] = []
            batch_bytes = 0
            for key, payload in blocks:
                csum = checksum(payload)
                name = self._stage(shm, payload, csum) if shm is not None and payload else None
                if name is not None:
                    assert shm is not None
                    staged.append(shm / name)
                    batch.append(pb.BlockChunk(hash=key, total_size=len(payload), checksum=csum, shm_name=name))
                    batch_bytes += len(payload)
                    if batch_bytes >= _STAGED_BATCH_BYTES:  # the server verifies these while we stage more
                        yield pb.PutRequest(staged=batch, ephemeral=ephemeral)
                        batch, batch_bytes = [], 0
                    continue
                if batch:
                    yield pb.PutRequest(staged=batch, ephemeral=ephemeral)
                    batch, batch_bytes = [], 0
                shm = None  # shared memory failed us: the rest goes as bytes
                for chunk in split_block(key, payload, csum):
                    yield pb.PutRequest(chunk=chunk, ephemeral=ephemeral)
            if batch:
                yield pb.PutRequest(staged=batch, ephemeral=ephemeral)

        try:
            response = self._stub.Put(requests(), timeout=self.timeout_s)
        finally:
            for path in staged:  # the server consumed those it stored; drop any it did not reach
                path.unlink(missing_ok=True)
        return int(response.num_new)

    def lookup(self, hashes: Sequence[BlockHash], lease_ttl_s: float | None = None) -> LookupResult:
        """How many leading hashes are present (and in which tier); pins them if lease_ttl_s."""
        self._report_reads([], now=True)
        response = self._stub.Lookup(
            pb.LookupRequest(hashes=list(hashes), lease_ttl_s=lease_ttl_s or 0.0), timeout=self.timeout_s
        )
        tiers = [_tier_name(t) for t in response.tiers]
        return LookupResult(int(response.num_hits), tiers, response.lease_id or None)

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Verified payloads in request order; None for a miss or a corrupt block."""
        keys = list(hashes)
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        reader = self._shm()
        if reader is not None:
            todo = self._read_shm(reader, keys, out)
        if todo:
            self._get_rpc(keys, todo, out, reader)
        return out

    def get_into(self, hashes: Sequence[BlockHash], buffers: Sequence[memoryview]) -> list[int | None]:
        """Like get, into caller buffers (one per hash, big enough): sizes written, None for a miss.

        The one-copy read path (DESIGN.md, "Transfer"): on the same host each block is copied once,
        from shared memory straight into the buffer, e.g. a slot of the engine's KV pool; `get`
        instead returns a new bytes object per block."""
        keys = list(hashes)
        sizes: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        reader = self._shm()
        if reader is not None:
            found_at: list[int] = []
            todo = []
            for i, key in enumerate(keys):
                sizes[i] = reader.read_into(key.hex(), buffers[i]) if len(key) == 32 else None
                (todo if sizes[i] is None else found_at).append(i)
            found = [keys[i] for i in found_at]
            self._report_reads(found)
        if todo:
            payloads = self.get([keys[i] for i in todo])
            for i, payload in zip(todo, payloads, strict=True):
                if payload is not None and len(payload) <= len(buffers[i]):
                    buffers[i][: len(payload)] = payload
                    sizes[i] = len(payload)
        return sizes

    def release(self, lease_id: str) -> None:
        self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self.timeout_s)

    def stats(self) -> StoreStats:
        self._report_reads([], now=True)
        r = self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        tiers = [
            TierStats(_tier_name(t.tier), t.blocks, t.bytes, t.capacity_bytes, t.hits, t.misses, t.evictions, t.demotions, t.promotions)
            for t in r.tiers
        ]
        return StoreStats(tiers, int(r.leases), int(r.pinned_blocks), int(r.checksum_failures))

    # -- extras --------------------------------------------------------------------------------

    def info(self) -> StoreInfo:
        r = self._stub.Info(pb.InfoRequest(), timeout=self.timeout_s)
        return StoreInfo(r.host_id, r.shm_dir, int(r.max_message_bytes), r.shm_token)

    def events(self) -> Iterator[BlockEvent]:
        """Blocks stored and removed, as they happen (no deadline; cancel by closing the client)."""
        for ev in self._stub.Events(pb.EventsRequest()):
            yield BlockEvent(ev.kind == pb.Event.KIND_STORED, list(ev.hashes), _tier_name(ev.tier) if ev.tier else None)

    def shm_dir(self) -> Path | None:
        """The server's shared-memory dir when this client can use it, else None."""
        reader = self._shm()
        return None if reader is None else Path(reader.dir)

    # -- internals -----------------------------------------------------------------------------

    def _shm(self) -> ShmReader | None:
        # Asks Info once, and again whenever the dir has gone (the server restarted elsewhere).
        if not self.use_shm:
            return None
        with self._shm_lock:
            reader = self._reader
            if self._shm_checked and (reader is None or os.path.isdir(reader.dir)):
                return reader
            if reader is not None:
                reader.close()
            try:
                info = self.info()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                info = StoreInfo("", "", 0)
            shm = usable_dir(info.shm_dir, info.shm_token) if info.host_id == host_id() else None
            self._reader = ShmReader(shm, self.shm_map_bytes) if shm else None
            self._shm_checked = True
            return self._reader

    def _forget_shm(self) -> None:
        with self._shm_lock:
            self._shm_checked = False

    # -- internals -----------------------------------------------------------------------------

    def _stage(self, shm: Path, payload: bytes, csum: int) -> str | None:
        try:
            return stage_block_file(shm, payload, csum)
        except OSError:  # the dir went away (server restarted) or shm is full
            self._forget_shm()
            return None

    def _read_shm(self, reader: ShmReader, keys: list[BlockHash], out: list[bytes | None]) -> list[int]:
        """Reads what lies in the shm tier; reports the reads so the server's LRU and hit counts
        stay exact; returns the positions still to fetch."""
        todo: list[int] = []
        found: list[BlockHash] = []
        for i, key in enumerate(keys):
            payload = reader.read(key.hex()) if len(key) == 32 else None
            if payload is None:
                todo.append(i)
            else:
                out[i] = payload
                found.append(key)
        self._report_reads(found)
        return todo

    def _report_reads(self, keys: list[BlockHash], *, now: bool = False) -> None:
        # Best effort, off the critical path: a Lookup touches the blocks read in place (LRU
        # order, hit counts). Reads are batched: one report in flight at a time, and at most one
        # every _REPORT_INTERVAL_S unless many keys wait; lookup/stats/close send what is left.
        with self._reports_lock:
            self._unreported.extend(keys)
            if not self._unreported:
                return
            in_flight = self._report is not None and not self._report.done()
            due = now or len(self._unreported) >= _REPORT_KEYS or time.monotonic() - self._reported_at >= _REPORT_INTERVAL_S
            if in_flight and now:
                self._report.exception()  # type: ignore[union-attr]
            elif in_flight or not due:
                return
            request = pb.LookupRequest(hashes=self._unreported)
            self._unreported = []
            self._reported_at = time.monotonic()
            self._report = self._stub.Lookup.future(request, timeout=self.timeout_s)
            if now:
                self._report.exception()

    def _get_rpc(self, keys: list[BlockHash], todo: list[int], out: list[bytes | None], reader: ShmReader | None) -> None:
        assembler = BlockAssembler(_NO_LIMIT)
        retry: list[int] = []
        pending = iter(todo)
        request = pb.GetRequest(hashes=[keys[i] for i in todo], via_shm=reader is not None)
        for response in self._stub.Get(request, timeout=self.timeout_s):
            if not response.found:
                next(pending)
                continue
            block = assembler.feed(response.chunk)
            if block is None:
                continue
            i = next(pending)
            if block.key != keys[i]:
                raise ValueError(f"store answered block {block.key.hex()[:16]} for {keys[i].hex()[:16]}")
            if block.shm_name:
                payload = reader.read(block.shm_name, block.checksum) if reader else None
                if payload is None:
                    retry.append(i)  # removed between the answer and the read
                    continue
                out[i] = payload
            elif block.payload is not None and checksum(block.payload) == block.checksum:
                out[i] = block.payload
            else:
                self.checksum_failures += 1
        assembler.finish()
        if retry:
            self._get_rpc(keys, retry, out, None)

