"""Disk tier: LMDB, crash-safe, written behind by one thread so no request waits on an fsync.

Writes and deletes land in a pending map (the latest op per key, read by `read`) and a writer
thread commits them in batches, one synced transaction each (group commit). A SIGKILL loses at
most the pending ops, never the database. Values are `block_format` records (header + payload),
verified on every read. The map is sized from the capacity with headroom and grown if ever full.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, NamedTuple

import lmdb

from kvstore.block_format import HEADER_BYTES, BlockHeader, CorruptBlock, pack_header, unpack_header, verify
from kvstore.tier import TierStorage
from kvstore.types import Buffer, Tier
from protos.block_hash import HASH_BYTES, BlockHash

log = logging.getLogger(__name__)

_MiB = 1024 * 1024
TOMBSTONE = None
# An LMDB meta page: page header (16 bytes), then magic, version, ..., the free DB's md_pad (the page
# size) at 40, and the last page used and the transaction id at 136 and 144.
_LMDB_META = struct.Struct("<16xII16xI92xQQ")
_LMDB_MAGIC = 0xBEEFC0DE
_MAX_PAGE_BYTES = 65536


class Record(NamedTuple):
    """A pending write: the block's header and its payload (bytes nobody changes any more)."""

    header: bytes
    payload: Buffer


def _size(record: Record | None) -> int:
    return 0 if record is None else HEADER_BYTES + len(record.payload)


class _SharedLock:
    """Many readers or one writer; the writer is only the rare map growth."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


def lmdb_damage(data_file: Path) -> str | None:
    """Why an LMDB data file cannot be opened safely, or None: no valid meta page, or a file shorter than
    its meta page says (LMDB maps the file, and reading a page past its end kills the process with
    SIGBUS). Read with plain reads, never mapped."""
    try:
        size = data_file.stat().st_size
        with data_file.open("rb") as f:
            head = f.read(2 * _MAX_PAGE_BYTES)
    except FileNotFoundError:
        return None  # a new tier
    if size == 0:
        return None  # LMDB initialises an empty file
    psize = _LMDB_META.unpack_from(head, 0)[2] if len(head) >= _LMDB_META.size else 0
    metas = [_LMDB_META.unpack_from(head, off) for off in (0, psize) if psize > 0 and off + _LMDB_META.size <= len(head)]
    valid = [m for m in metas if m[0] == _LMDB_MAGIC and m[1] == 1 and m[2] == psize]
    if not valid or psize & (psize - 1) or not 512 <= psize <= _MAX_PAGE_BYTES:
        return "no valid LMDB meta page"
    *_, last_page, _ = max(valid, key=lambda m: m[-1])  # the newest transaction's meta page
    need = (last_page + 1) * psize
    if size < need:
        return f"data file is {size} bytes, its meta page says {need}: truncated"
    return None


def initial_map_size(capacity_bytes: int) -> int:
    # Overflow pages round each value up to 4 KiB and freed pages are reused only once no reader
    # holds an older snapshot: twice the capacity plus slack keeps MapFullError away (sparse file).
    return 2 * capacity_bytes + 64 * _MiB


class DiskTier(TierStorage):
    tier = Tier.DISK

    def __init__(self, path: str | Path, capacity_bytes: int, *, max_pending_bytes: int = 64 * _MiB) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._lock_dir(self.path)
        self._map_size = initial_map_size(capacity_bytes)
        self.quarantined: Path | None = None  # where a damaged tier found at start was moved
        self._env = self._open()
        self._env_lock = _SharedLock()
        self._cond = threading.Condition()
        self._pending: dict[BlockHash, Record | None] = {}
        self._pending_bytes = 0
        self._max_pending_bytes = max_pending_bytes
        self._stopping = False
        self.map_growths = 0
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-disk-writer", daemon=True)
        self._writer.start()

    def _open(self) -> lmdb.Environment:
        """The LMDB environment; a damaged one (see lmdb_damage, or one LMDB refuses or cannot walk) is
        moved aside and an empty one opened in its place: the tier only holds cache."""
        problem = lmdb_damage(self.path / "data.mdb")
        if problem is None:
            env = None
            try:
                env = self._lmdb()
                with env.begin() as txn:  # walks every branch and leaf page
                    for _ in txn.cursor().iternext(keys=True, values=False):
                        pass
                return env
            except lmdb.Error as exc:
                problem = f"{type(exc).__name__}: {exc}"
                if env is not None:
                    env.close()
        aside = self.path.with_name(f"{self.path.name}.quarantined-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        aside.mkdir()
        for name in ("data.mdb", "lock.mdb"):
            if (self.path / name).exists():
                os.rename(self.path / name, aside / name)
        log.error("disk tier %s is damaged (%s): moved to %s, starting with an empty one", self.path, problem, aside)
        self.quarantined = aside
        return self._lmdb()

    def _lmdb(self) -> lmdb.Environment:
        return lmdb.open(str(self.path), map_size=self._map_size, max_readers=512, readahead=False)

    @staticmethod
    def _lock_dir(path: Path) -> IO[str]:
        f = (path / "kvstore.lock").open("w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ValueError(f"disk path {path} is in use by another kvstore process") from None
        return f

    # -- TierStorage ---------------------------------------------------------------------------

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        # No copy here (the store's lock is held): the writer thread joins header and payload.
        self._enqueue(key, Record(pack_header(len(payload), checksum, ephemeral=ephemeral, seq=seq), payload))

    def delete(self, key: BlockHash) -> None:
        self._enqueue(key, TOMBSTONE)

    def read(self, key: BlockHash) -> Buffer | None:
        """The verified payload, None when absent; raises CorruptBlock for a damaged record."""
        with self._cond:
            if key in self._pending:
                record = self._pending[key]
                return None if record is None else record.payload
        with self._env_lock.shared(), self._env.begin(buffers=True) as txn:
            value = txn.get(key)
            if value is None:
                return None
            view = memoryview(value)
            header = unpack_header(view)
            payload = view[HEADER_BYTES:]
            verify(header, payload)
            return bytes(payload)

    def keys(self) -> set[BlockHash]:
        with self._cond:
            pending = dict(self._pending)
        with self._env_lock.shared(), self._env.begin() as txn:
            stored = {BlockHash(bytes(k)) for k in txn.cursor().iternext(keys=True, values=False)}
        stored.discard(BlockHash(b""))
        return (stored | {k for k, v in pending.items() if v is not None}) - {
            k for k, v in pending.items() if v is None
        }

    def flush(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            done = self._cond.wait_for(lambda: not self._pending, timeout=timeout_s)
        if done:
            with self._env_lock.shared():
                self._env.sync(True)
        return done

    def close(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._writer.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():  # mid-commit: LMDB stays consistent if the process exits now
            log.warning("disk tier: %d writes not committed at close", len(self._pending))
            return
        self._env.close()
        self._lock_file.close()

    # -- disk-only ------------------------------------------------------------------------------

    def scan(self) -> Iterator[tuple[BlockHash, BlockHeader]]:
        """Every stored block's key and header (payloads are not read); bad records are deleted."""
        bad: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                k = bytes(key)
                try:
                    header = unpack_header(memoryview(value)[:HEADER_BYTES])
                    if len(k) != HASH_BYTES or len(value) != HEADER_BYTES + header.size:
                        raise CorruptBlock("bad key or record length")
                except CorruptBlock:
                    bad.append(k)
                    continue
                yield BlockHash(k), header
        if bad:
            log.warning("deleting %d unreadable records from %s", len(bad), self.path)
            with self._env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k)

    def wait_for_room(self, timeout_s: float = 30.0) -> None:
        """Backpressure: blocks (outside the store's lock) while too many writes are pending."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending_bytes <= self._max_pending_bytes, timeout=timeout_s)

    # -- writer ---------------------------------------------------------------------------------

    def _enqueue(self, key: BlockHash, record: Record | None) -> None:
        with self._cond:
            old = self._pending.get(key)
            self._pending_bytes += _size(record) - _size(old)
            self._pending[key] = record
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopping)
                if not self._pending and self._stopping:
                    return
                batch = dict(self._pending)
            self._commit(batch)
            with self._cond:
                for key, record in batch.items():
                    if self._pending.get(key, 0) is record:
                        del self._pending[key]
                        self._pending_bytes -= _size(record)
                self._cond.notify_all()

    def _commit(self, batch: dict[BlockHash, Record | None]) -> None:
        for _ in range(8):
            try:
                with self._env_lock.shared(), self._env.begin(write=True) as txn:
                    for key, record in batch.items():
                        if record is None:
                            txn.delete(key)
                        else:
                            txn.put(key, record.header + record.payload)
                return
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error:
                log.exception("disk tier: dropping a batch of %d writes", len(batch))
                return
        log.error("disk tier: map still full after growing; dropping %d writes", len(batch))

    def _grow(self) -> None:
        with self._env_lock.exclusive():
            self._map_size *= 2
            self._env.set_mapsize(self._map_size)
            self.map_growths += 1
        log.warning("disk tier: LMDB map grown to %d bytes", self._map_size)
