"""The host tier's shared-memory arena: one sealed segment of fixed-size slots, and its client side.

The store creates the segment once (a memfd, pre-faulted, sealed against shrinking and growing)
and hands its file descriptor to same-host clients over a Unix socket in its private shm dir
(SCM_RIGHTS). A client maps it once and moves a block with one copy, into a slot it reserved
(put) or out of the slot the store names (get). Nothing another process does to shared memory can
kill a reader: the segment cannot be truncated (seals), so no access faults with SIGBUS, and a
slot whose bytes changed (reused, garbage) fails the reader's checksum and is a miss.

Slots come from slab classes, as in memcached: a class per slot size (block sizes rounded up to
64 bytes; a deployment has one full-block size and a few tail sizes), each carving runs of 4 MiB
pages into slots. A run whose slots are all free goes back to the arena, for any class.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvstore.types import Buffer

PAGE_BYTES = 4 << 20
SLOT_ALIGN = 64
MIN_SLOTS_PER_RUN = 16  # a run spans enough pages that rounding wastes at most 1/16 of it
SOCKET_NAME = "arena.sock"
_GREETING = b"kvserve-arena/1"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_UCRED = struct.Struct("3i")


def host_id() -> str:
    """Equal for processes on the same machine (its boot id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def slot_bytes(size: int) -> int:
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(slots=True)
class SlabClass:
    slot: int  # bytes per slot
    run_pages: int  # pages per run
    free: deque[int] = field(default_factory=deque)  # free slot offsets, reused oldest first
    used: dict[int, int] = field(default_factory=dict)  # run start -> slots in use


class Arena:
    """Slots in one shared-memory segment (server side). Not thread-safe: the store's lock guards it."""

    def __init__(self, capacity: int, *, page_bytes: int = PAGE_BYTES, name: str = "kvserve-arena") -> None:
        self.page_bytes = page_bytes
        num_pages = max(1, -(-capacity // page_bytes))
        self.size = num_pages * page_bytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            os.posix_fallocate(self.fd, 0, self.size)  # every page exists now: no fault can fail later
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        self._pages = bytearray(num_pages)  # 1: page belongs to a run
        self._classes: dict[int, SlabClass] = {}
        self._owner: dict[int, SlabClass] = {}  # slot in use -> its class
        self._run_of: dict[int, int] = {}  # every slot of every run -> its run's start

    def alloc(self, size: int) -> int | None:
        """The offset of a free slot for `size` bytes, or None when none can be had."""
        cls = self._class(size)
        if cls is None or (not cls.free and not self._add_run(cls)):
            return None
        offset = cls.free.popleft()
        run = self._run_of[offset]
        cls.used[run] = cls.used.get(run, 0) + 1
        self._owner[offset] = cls
        return offset

    def free(self, offset: int) -> None:
        cls = self._owner.pop(offset)
        run = self._run_of[offset]
        cls.used[run] -= 1
        cls.free.append(offset)
        if cls.used[run] == 0:  # the run's pages go back, for any class
            del cls.used[run]
            slots = self._slots(cls, run)
            for o in slots:
                del self._run_of[o]
            gone = set(slots)
            cls.free = deque(o for o in cls.free if o not in gone)
            first = run // self.page_bytes
            self._pages[first : first + cls.run_pages] = bytes(cls.run_pages)

    def has_room(self, size: int) -> bool:
        cls = self._class(size)
        return cls is not None and (bool(cls.free) or self._find_run(cls.run_pages) >= 0)

    def slot_size(self, offset: int) -> int | None:
        """The size of the slot in use at `offset`, or None if no slot is in use there."""
        owner = self._owner.get(offset)
        return None if owner is None else owner.slot

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)

    def _class(self, size: int) -> SlabClass | None:
        slot = slot_bytes(max(size, 1))
        cls = self._classes.get(slot)
        if cls is None:
            run_pages = -(-slot * MIN_SLOTS_PER_RUN // self.page_bytes)
            if run_pages > len(self._pages):
                run_pages = -(-slot // self.page_bytes)  # a small arena: fewer slots per run
                if run_pages > len(self._pages):
                    return None
            cls = self._classes[slot] = SlabClass(slot, run_pages)
        return cls

    def _slots_per_run(self, cls: SlabClass) -> int:
        return cls.run_pages * self.page_bytes // cls.slot

    def _slots(self, cls: SlabClass, run: int) -> list[int]:
        return [run + i * cls.slot for i in range(self._slots_per_run(cls))]

    def _find_run(self, pages: int) -> int:
        return self._pages.find(bytes(pages))

    def _add_run(self, cls: SlabClass) -> bool:
        first = self._find_run(cls.run_pages)
        if first < 0:
            return False
        self._pages[first : first + cls.run_pages] = b"\x01" * cls.run_pages
        run = first * self.page_bytes
        slots = self._slots(cls, run)
        self._run_of.update((o, run) for o in slots)
        cls.free.extend(slots)
        return True


class ArenaSocket:
    """Hands the arena's file descriptor to whoever connects to `path` (same user only)."""

    def __init__(self, arena: Arena, path: Path) -> None:
        self.arena = arena
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="kvstore-arena-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    if _peer_uid(conn) == os.getuid():
                        socket.send_fds(conn, [_GREETING], [self.arena.fd])
                except OSError:
                    continue

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self.path.unlink(missing_ok=True)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(creds)[1])  # struct ucred: pid, uid, gid


class ArenaMap:
    """A client's mapping of a store's arena: copies a block out of a slot or into one."""

    def __init__(self, socket_path: Path | str, timeout_s: float = 2.0) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(socket_path))
            msg, fds, _, _ = socket.recv_fds(s, len(_GREETING), 1)
        if msg != _GREETING or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(f"{socket_path} is not a kvserve arena socket")
        fd = fds[0]
        try:
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise OSError("the store's arena is not sealed against resizing: not mapping it")
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # no faults later
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def read(self, offset: int, size: int, checksum: int) -> bytes | None:
        """A copy of the slot's `size` bytes if they match `checksum`, else None."""
        if offset < 0 or offset + size > self.size:
            return None
        payload = bytes(self.view[offset : offset + size])
        return payload if xxhash.xxh3_64_intdigest(payload) == checksum else None

    def read_into(self, offset: int, size: int, checksum: int, out: Sequence[memoryview]) -> bool:
        """Copies the slot's `size` bytes into the buffers `out`, in order (e.g. a block's header
        into one and its tensor straight into a KV pool slot); True if they match `checksum`."""
        if offset < 0 or offset + size > self.size or size > sum(len(b) for b in out):
            return False
        hasher = xxhash.xxh3_64()
        for buf in out:
            n = min(len(buf), size)
            dest = buf[:n]
            dest[:] = self.view[offset : offset + n]
            hasher.update(dest)  # hashed while still in cache
            offset, size = offset + n, size - n
        return hasher.intdigest() == checksum

    def write(self, offset: int, parts: Sequence[Buffer]) -> int:
        """Copies `parts` one after another into the slot at `offset`; the checksum of the whole,
        taken from the copy while it is still in cache (a fraction of the cost of hashing apart)."""
        if offset < 0 or offset + sum(len(p) for p in parts) > self.size:
            raise ValueError(f"slot at {offset} lies outside the arena")
        hasher = xxhash.xxh3_64()
        for part in parts:
            dest = self.view[offset : offset + len(part)]
            dest[:] = part
            hasher.update(dest)
            offset += len(part)
        return hasher.intdigest()

    def close(self) -> None:
        self.view.release()
        self._map.close()
