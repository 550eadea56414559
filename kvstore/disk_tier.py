"""Disk tier: LMDB, crash-safe, written behind by one thread so no request waits on an fsync.

Writes and deletes land in a pending map (the latest op per key, read by `read`) and a writer
thread commits them in batches, one synced transaction each (group commit). A SIGKILL loses at
most the pending ops, never the database. Values are `block_format` records (header + payload), made by
the writer thread (with a record key, sealed: the payload encrypted) and their headers checked at start, where a
record that is not this store's under its key (moved, forged, another deployment's) or of an older layout is
deleted; every read verifies the payload too. The map is sized from the capacity with headroom and grown if
ever full.

A disk that fails at runtime never takes the store down. A write that fails (the disk full or
read-only, LMDB's map unable to grow, an I/O error) stops the tier taking blocks (`failure`, one log
line): the blocks it did not write are reported to `on_lost` (the store forgets them) and counted
in `failed_writes`; what it had committed is still read. A data file cut short under the running
process (LMDB reads it through mmap, and a page past the file's end is SIGBUS) is seen by an fstat
before each read transaction and each commit, and is damage: the tier reads nothing more and
reports everything lost; the next start moves it aside (`lmdb_damage`). The residual risk: a file
cut between that check and the read that follows it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, NamedTuple

import lmdb

from kvserve.rpc.auth import private_folder
from kvstore.block_format import (
    HEADER_BYTES,
    BlockHeader,
    CorruptBlock,
    ForeignRecord,
    open_payload,
    pack_record,
    unpack_header,
)
from kvstore.record_key import RecordKey
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
# A named database beside the records (in LMDB's main one): each record's header again, written in the same
# transaction. Start reads it alone, a few leaf pages, where reading each record's header would read one page
# of every record: on a cold page cache 99 s for 16,384 records of a 4 GiB tier here, against 0.5 s warm.
HEADERS_DB = b"kvserve-headers"


class Record(NamedTuple):
    """A pending write: a payload (bytes nobody changes any more) and what its header says."""

    payload: Buffer
    checksum: int
    ephemeral: bool
    seq: int


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


def required_bytes(read: Callable[[int, int], bytes]) -> int | None:
    """How long an LMDB data file must be by its newest valid meta page (every page up to the last one
    used), or None when neither meta page is valid. `read(offset, n)` reads the file (plain reads,
    never mapped)."""
    first = read(0, _LMDB_META.size)
    if len(first) < _LMDB_META.size:
        return None
    psize = _LMDB_META.unpack(first)[2]
    if psize & (psize - 1) or not 512 <= psize <= _MAX_PAGE_BYTES:
        return None
    metas = [_LMDB_META.unpack(m) for m in (first, read(psize, _LMDB_META.size)) if len(m) == _LMDB_META.size]
    valid = [m for m in metas if m[0] == _LMDB_MAGIC and m[1] == 1 and m[2] == psize]
    if not valid:
        return None
    *_, last_page, _ = max(valid, key=lambda m: m[-1])  # the newest transaction's meta page
    return int(last_page + 1) * psize


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
    need = required_bytes(lambda offset, n: head[offset : offset + n])
    if need is None:
        return "no valid LMDB meta page"
    if size < need:
        return f"data file is {size} bytes, its meta page says {need}: truncated"
    return None


def initial_map_size(capacity_bytes: int) -> int:
    # Overflow pages round each value up to 4 KiB and freed pages are reused only once no reader
    # holds an older snapshot: twice the capacity plus slack keeps MapFullError away (sparse file).
    return 2 * capacity_bytes + 64 * _MiB


class DiskTier(TierStorage):
    tier = Tier.DISK

    def __init__(self, path: str | Path, capacity_bytes: int, *, max_pending_bytes: int = 64 * _MiB,
                 record_key: RecordKey | None = None) -> None:
        """`record_key`: the key records are sealed under (None: in the clear, bound to their keys by checksum
        only)."""
        self.path = Path(path)
        self.record_key = record_key
        self.foreign_records = 0  # records found at start that were not this store's under their key (deleted)
        private_folder(self.path, ("data.mdb", "lock.mdb", "kvstore.lock"))  # prompts can be read back from KV
        self._lock_file = self._lock_dir(self.path)
        self._map_size = initial_map_size(capacity_bytes)
        self.quarantined: Path | None = None  # where a damaged tier found at start was moved
        self._env = self._open()
        self._data = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)  # fstat: is the file whole?
        self._need = self._required_bytes()  # bytes the data file must hold for LMDB to read it
        self._env_lock = _SharedLock()
        self._cond = threading.Condition()
        self._pending: dict[BlockHash, Record | None] = {}
        self._pending_bytes = 0
        self._max_pending_bytes = max_pending_bytes
        self._stopping = False
        self.map_growths = 0
        self.failed_writes = 0  # blocks whose write failed (the tier does not hold them)
        self.on_lost: Callable[[list[BlockHash] | None], None] | None = None  # keys not written; None: all
        self._failure: str | None = None
        self._damaged = False  # the data file was cut short: LMDB's map must not be read any more
        self._lost_all = False  # damaged, not yet reported to on_lost
        self._forgotten: set[BlockHash] = set()  # deleted after the tier failed: still in LMDB, not held
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-disk-writer", daemon=True)
        self._writer.start()

    def _open(self) -> lmdb.Environment:
        """The LMDB environment; a damaged one (see lmdb_damage, or one LMDB refuses or cannot walk) is
        moved aside and an empty one opened in its place: the tier only holds cache. One of an older layout
        (records, no headers database) is emptied: its records would all be misses."""
        problem = lmdb_damage(self.path / "data.mdb")
        if problem is None:
            env = None
            try:
                env = self._lmdb()
                with env.begin() as txn:
                    older = txn.get(HEADERS_DB) is None and env.stat()["entries"] > 0
                if older:
                    log.warning("disk tier %s holds records of an older layout: starting with an empty one", self.path)
                    env.close()
                    for name in ("data.mdb", "lock.mdb"):
                        (self.path / name).unlink(missing_ok=True)
                    env = self._lmdb()
                self._headers = env.open_db(HEADERS_DB)
                with env.begin() as txn:  # walks every branch and leaf page of both databases
                    for db in (None, self._headers):
                        for _ in txn.cursor(db=db).iternext(keys=True, values=False):
                            pass
                return env
            except lmdb.Error as exc:
                problem = f"{type(exc).__name__}: {exc}"
                if env is not None:
                    env.close()
        aside = self.path.with_name(f"{self.path.name}.quarantined-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        aside.mkdir(mode=0o700)
        for name in ("data.mdb", "lock.mdb"):
            if (self.path / name).exists():
                os.rename(self.path / name, aside / name)
        log.error("disk tier %s is damaged (%s): moved to %s, starting with an empty one", self.path, problem, aside)
        self.quarantined = aside
        env = self._lmdb()
        self._headers = env.open_db(HEADERS_DB)
        return env

    def _lmdb(self) -> lmdb.Environment:
        return lmdb.open(str(self.path), map_size=self._map_size, max_readers=512, readahead=False, mode=0o600,
                         max_dbs=1)

    @staticmethod
    def _lock_dir(path: Path) -> IO[str]:
        f = os.fdopen(os.open(path / "kvstore.lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600), "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ValueError(f"disk path {path} is in use by another kvstore process") from None
        return f

    # -- TierStorage ---------------------------------------------------------------------------

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        # No copy and no MAC here (the store's lock is held): the writer thread makes the record.
        self._enqueue(key, Record(payload, checksum, ephemeral, seq))

    def delete(self, key: BlockHash) -> None:
        self._enqueue(key, TOMBSTONE)

    @property
    def failure(self) -> str | None:
        return self._failure

    def read(self, key: BlockHash) -> Buffer | None:
        """The verified payload, None when absent; raises CorruptBlock for a damaged record."""
        with self._cond:
            if key in self._pending:
                record = self._pending[key]
                return None if record is None else record.payload
            if key in self._forgotten:
                return None
        if not self._intact():
            return None
        with self._env_lock.shared(), self._env.begin(buffers=True) as txn:
            value = txn.get(key)
            if value is None:
                return None
            view = memoryview(value)
            header = unpack_header(view, key, self.record_key)
            return open_payload(header, key, view[HEADER_BYTES:], self.record_key)

    def keys(self) -> set[BlockHash]:
        with self._cond:
            pending = dict(self._pending)
            forgotten = set(self._forgotten)
        stored: set[BlockHash] = set()
        if self._intact():
            with self._env_lock.shared(), self._env.begin() as txn:
                stored = {BlockHash(bytes(k)) for k in txn.cursor().iternext(keys=True, values=False)
                          if len(k) == HASH_BYTES}
        return (stored | {k for k, v in pending.items() if v is not None}) - {
            k for k, v in pending.items() if v is None
        } - forgotten

    def flush(self, timeout_s: float | None = None) -> bool:
        """True when every write was committed and synced; False past the timeout, or once the tier has
        failed (it dropped writes)."""
        with self._cond:
            done = self._cond.wait_for(lambda: not self._pending, timeout=timeout_s)
        if done and self._failure is None:
            try:
                with self._env_lock.shared():
                    self._env.sync(True)
            except lmdb.Error as exc:
                self._fail(f"syncing failed ({type(exc).__name__}: {exc})")
        return done and self._failure is None

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
        os.close(self._data)
        self._lock_file.close()

    # -- disk-only ------------------------------------------------------------------------------

    def scan(self) -> Iterator[tuple[BlockHash, BlockHeader]]:
        """Every stored block's key and checked header, from the headers database (no record is read: each
        read checks its own). Headers that fail their check, or whose record is gone, and records without a
        header are deleted; headers not this store's under their key are counted (`foreign_records`)."""
        bad: list[bytes] = []
        foreign = 0
        with self._env.begin(buffers=True) as txn:
            records = {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)} - {HEADERS_DB}
            for key, value in txn.cursor(db=self._headers):
                k = bytes(key)
                try:
                    if k not in records:
                        raise CorruptBlock("a header without its record")
                    header = unpack_header(value, k, self.record_key)
                except CorruptBlock as exc:
                    foreign += isinstance(exc, ForeignRecord)
                    bad.append(k)
                    continue
                records.discard(k)
                yield BlockHash(k), header
        self.foreign_records += foreign
        if bad or records:
            log.warning("deleting %d unreadable records from %s: %d not this store's under their keys (moved, forged, "
                        "or under another record key), %d damaged or of an older layout", len(bad) + len(records),
                        self.path, foreign, len(bad) + len(records) - foreign)
            with self._env.begin(write=True) as txn:
                for k in [*bad, *records]:
                    txn.delete(k)
                    txn.delete(k, db=self._headers)

    def wait_for_room(self, timeout_s: float = 30.0) -> None:
        """Backpressure: blocks (outside the store's lock) while too many writes are pending."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending_bytes <= self._max_pending_bytes, timeout=timeout_s)

    # -- writer ---------------------------------------------------------------------------------

    def _enqueue(self, key: BlockHash, record: Record | None) -> None:
        with self._cond:
            if record is not None:
                self._forgotten.discard(key)
            old = self._pending.get(key)
            self._pending_bytes += _size(record) - _size(old)
            self._pending[key] = record
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopping or self._lost_all)
                if not self._pending and self._stopping and not self._lost_all:
                    return
                batch = dict(self._pending)
            committed = self._commit(batch) if batch else True
            dropped: list[BlockHash] = []  # puts not written (a later op on the same key is in the next batch)
            with self._cond:
                for key, record in batch.items():
                    if self._pending.get(key, 0) is record:
                        del self._pending[key]
                        self._pending_bytes -= _size(record)
                        if not committed and record is None:
                            self._forgotten.add(key)
                        elif not committed:
                            dropped.append(key)
                self.failed_writes += len(dropped)
                lost = None if self._lost_all else dropped
                self._lost_all = False
                self._cond.notify_all()
            if (lost is None or lost) and self.on_lost is not None:
                try:
                    self.on_lost(lost)
                except Exception:
                    log.exception("disk tier: reporting lost blocks failed")

    def _commit(self, batch: dict[BlockHash, Record | None]) -> bool:
        """Writes a batch in one transaction; False when it could not (the tier has failed, and says why)."""
        if self._failure is not None or not self._intact():
            return False
        values = {key: None if r is None else pack_record(key, r.payload, r.checksum, self.record_key,
                                                          ephemeral=r.ephemeral, seq=r.seq)
                  for key, r in batch.items()}  # sealed before the transaction: it stays short
        for _ in range(8):
            try:
                with self._env_lock.shared(), self._env.begin(write=True) as txn:
                    for key, value in values.items():
                        if value is None:
                            txn.delete(key)
                            txn.delete(key, db=self._headers)
                        else:
                            txn.put(key, value)
                            txn.put(key, value[:HEADER_BYTES], db=self._headers)
                self._need = max(self._need, self._required_bytes())
                return True
            except lmdb.MapFullError:
                try:
                    self._grow()
                except (lmdb.Error, OSError) as exc:
                    self._fail(f"its LMDB map is full and could not grow ({type(exc).__name__}: {exc})")
                    return False
            except (lmdb.Error, OSError) as exc:
                self._fail(f"a write failed ({type(exc).__name__}: {exc})")
                return False
        self._fail(f"its LMDB map is still full at {self._map_size} bytes")
        return False

    def _required_bytes(self) -> int:
        return required_bytes(lambda offset, n: os.pread(self._data, n, offset)) or 0

    def _intact(self) -> bool:
        """Whether LMDB's map may be read: the data file still holds every page LMDB may touch (an fstat,
        about a microsecond). A file cut short is damage: the tier stops for good."""
        if self._damaged:
            return False
        # The need first: a commit that raises it meanwhile has already grown the file past it.
        need = self._need
        size = os.fstat(self._data).st_size
        if size >= need:
            return True
        self._fail(f"its data file was cut to {size} bytes while LMDB needs {need}", damaged=True)
        return False

    def _fail(self, reason: str, *, damaged: bool = False) -> None:
        """Stops the tier taking blocks; one log line for the failure (and one more if damage follows)."""
        with self._cond:
            first = self._failure is None or (damaged and not self._damaged)
            if first:
                self._failure = reason
            if damaged and not self._damaged:
                self._damaged = self._lost_all = True
            self._cond.notify_all()
        if first:
            log.error("disk tier %s stopped taking blocks: %s. The memory tiers go on serving; blocks it did "
                      "not write are dropped (disk_write_failures)%s", self.path, reason,
                      "; it reads nothing more and is moved aside at the next start" if damaged else
                      "; what it holds is still read")

    def _grow(self) -> None:
        with self._env_lock.exclusive():
            self._map_size *= 2
            self._env.set_mapsize(self._map_size)
            self.map_growths += 1
        log.warning("disk tier: LMDB map grown to %d bytes", self._map_size)
