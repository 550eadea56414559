"""The host tier's shared-memory arena: one sealed segment of fixed-size slots, and its client side.

The store creates the segment once (a memfd, pre-faulted, sealed against shrinking and growing)
and hands its file descriptor to same-host clients over a Unix socket in its private shm dir
(SCM_RIGHTS). A client maps it once and moves a block with one copy, into a slot it reserved
(put) or out of the slot the store names (get). Nothing another process does to shared memory can
kill a reader: the segment cannot be truncated (seals), so no access faults with SIGBUS, and a
slot whose bytes changed (reused, garbage) fails the reader's checksum and is a miss. Slots come
from a slab allocator (kvstore/slab.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import xxhash

from kvstore.slab import PAGE_BYTES, SlabAllocator
from kvstore.types import Buffer

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


class Arena:
    """Slots in one shared-memory segment (server side). Not thread-safe: the store's lock guards it."""

    def __init__(self, capacity: int, *, page_bytes: int = PAGE_BYTES, name: str = "kvserve-arena") -> None:
        self.slots = SlabAllocator(capacity, page_bytes)
        self.size = self.slots.size
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

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)


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
