"""The store's arenas as same-host clients see them: a socket that hands out one buffer of fixed-size
slots, and the calls on it (a client opens it with kvstore/arena_map.py's ArenaMap).

The host tier's arena is shared memory: the store creates the segment once (a memfd, pre-faulted,
sealed against shrinking and growing) and hands its file descriptor to same-host clients over a Unix
socket in its private shm dir (SCM_RIGHTS), then answers that client's same-host calls on the same connection. A client maps it
once and moves a block with one copy, into a slot it reserved (put) or out of the slot the store
names (get). Nothing another process does to shared memory can
kill a reader: the segment cannot be truncated (seals), so no access faults with SIGBUS, and a
slot whose bytes changed (reused, garbage) fails the reader's checksum and is a miss. Slots come
from a slab allocator (kvstore/slab.py).

The device tier's arena (kvstore/device_tier.py) goes through the same socket and calls: its greeting
says what the buffer is ("kind": memfd, cpu-tensor, cuda-ipc) and how to open it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvserve.rpc.server import GRPC_MESSAGE_LIMIT
from kvstore.slab import PAGE_BYTES
from kvstore.types import Buffer, Part, fill

log = logging.getLogger(__name__)

SOCKET_NAME = "arena.sock"
GREETING = b"kvserve-arena/2\n"  # then the buffer's description, as JSON
MAX_GREETING = 4096
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_UCRED = struct.Struct("3i")
_SUN_PATH_BYTES = 107  # sockaddr_un's sun_path, less its terminating NUL


def host_id() -> str:
    """Equal for processes on the same machine (its boot id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


class Shared(Protocol):
    def export(self) -> tuple[dict[str, Any], list[int]]:
        """What a client needs to open the buffer: the greeting's fields, and the fds it carries."""


def scatter(payload: Buffer, parts: Sequence[Part]) -> bool:
    """Copies `payload` into the buffers `parts`, one after another; False (nothing copied) if they are
    too small."""
    if len(payload) > sum(len(b) for b in parts):
        return False
    view = memoryview(payload)
    for buf in parts:
        n = min(len(buf), len(view))
        fill(buf, view[:n])
        view = view[n:]
    return True


class Arena:
    """One sealed shared-memory segment of `capacity` bytes rounded up to pages (the store's side)."""

    def __init__(self, capacity: int, *, page_bytes: int = PAGE_BYTES, name: str = "kvserve-arena") -> None:
        self.size = max(1, -(-capacity // page_bytes)) * page_bytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            # Pages are taken as blocks are first written: the store holds what its tier holds, up to `capacity`.
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)

    def export(self) -> tuple[dict[str, Any], list[int]]:
        return {"kind": "memfd", "size": self.size}, [self.fd]

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)


@dataclasses.dataclass(slots=True)
class Connection:
    """One client's connection to the same-host channel: its process (0 where the kernel cannot name it in the
    store's PID namespace: a caller in another container) and its number, for per-caller limits, and the
    reservations it holds (they end when it closes)."""

    pid: int
    number: int = 0
    reservations: set[str] = dataclasses.field(default_factory=set)

    @property
    def caller(self) -> str:
        """What the store's per-caller limits name it: its process, else its connection (a service holds one); by
        gRPC a caller is its certificate's name, or without TLS its host. Only processes of the store's user
        reach this channel, and those could write into the arena itself: the limits keep its well-behaved
        callers from crowding each other out, not it from them."""
        return f"local-pid:{self.pid}" if self.pid else f"local-connection:{self.number}"


Handler = Callable[[int, bytes, Connection], bytes]  # (method, request, the calling connection) -> reply


class LocalCallError(OSError):
    """The store refused a call on the same-host channel; `status` names its gRPC status."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@contextlib.contextmanager
def unix_address(path: Path | str) -> Iterator[str]:
    """`path` as an address to bind or connect a Unix socket to: itself where it fits sun_path, else the same
    file reached through /proc/self/fd and its folder (Linux), so a store under a deep folder still serves."""
    path = str(path)
    if len(os.fsencode(path)) <= _SUN_PATH_BYTES:
        yield path
        return
    folder = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{os.path.basename(path)}"
    finally:
        os.close(folder)


class ArenaSocket:
    """The same-host channel: hands the arena (its description, and its file descriptor if it has one) to
    whoever connects to `path` (same user only), then answers that connection's calls (Lookup, Get,
    Reserve, Put) with `handler`: a round trip of tens of microseconds where gRPC takes half a millisecond. Reservations made on a
    connection end when it closes."""

    def __init__(self, arena: Shared, path: Path, handler: Handler | None = None, max_connections: int = 256) -> None:
        self._fields, self._fds = arena.export()
        self._accepted = 0
        self.path = path
        self.handler = handler
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(path) as address:
            self._sock.bind(address)
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
            pid, uid = _peer(conn)
            if uid != os.getuid() or not self._slots.acquire(blocking=False):
                conn.close()
                continue
            self._accepted += 1
            threading.Thread(target=self._connection, args=(conn, Connection(pid, self._accepted)),
                             name="kvstore-arena-client", daemon=True).start()

    def _connection(self, conn: socket.socket, peer: Connection) -> None:
        try:
            with conn:
                # the methods it answers: a client asks only those (a store before Lookup named none)
                fields = self._fields if self.handler is None else {**self._fields, "methods": list(METHODS)}
                greeting = GREETING + json.dumps(fields).encode()
                if self._fds:
                    socket.send_fds(conn, [greeting], self._fds)
                else:
                    conn.sendall(greeting)
                while (request := recv_frame(conn)) is not None:
                    method, body = request
                    send_frame(conn, *self._answer(method, body, peer))
        except OSError:
            pass  # the client went away
        finally:
            self._slots.release()
            if self.handler is not None and peer.reservations:
                with contextlib.suppress(Exception):
                    self.handler(END_RESERVATIONS, b"", peer)

    def _answer(self, method: int, body: bytes, peer: Connection) -> tuple[int, bytes]:
        if self.handler is None:
            return STATUSES.index("UNIMPLEMENTED"), b"this store answers no calls on its arena socket"
        try:
            return 0, self.handler(method, body, peer)
        except Exception as exc:  # the status the store names, as its gRPC server would
            status = getattr(exc, "grpc_status", "INTERNAL")
            if status not in STATUSES or status == "INTERNAL":
                status = "INTERNAL"
                log.exception("unhandled error in method %d on the arena socket", method)
            return STATUSES.index(status), str(exc).encode()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self.path.unlink(missing_ok=True)


GET, RESERVE, PUT, END_RESERVATIONS, LOOKUP = 1, 2, 3, 4, 5  # methods of the same-host channel
METHODS = (GET, RESERVE, PUT, LOOKUP)  # what a client may call (END_RESERVATIONS is the store's own)
STATUSES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "UNIMPLEMENTED", "INTERNAL")
_FRAME = struct.Struct("<IB")  # body length, method (request) or status index (reply)
MAX_FRAME_BYTES = GRPC_MESSAGE_LIMIT  # the messages of the RPCs, so as large as gRPC takes them (no block's bytes)


def send_frame(conn: socket.socket, kind: int, body: bytes) -> None:
    conn.sendall(_FRAME.pack(len(body), kind) + body)


def recv_frame(conn: socket.socket) -> tuple[int, bytes] | None:
    head = _recv_exactly(conn, _FRAME.size)
    if head is None:
        return None
    length, kind = _FRAME.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise OSError(f"frame of {length} bytes on the arena socket")
    body = _recv_exactly(conn, length) if length else b""
    if body is None:
        raise OSError("the arena socket closed inside a frame")
    return kind, body


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            if buf:
                raise OSError("the arena socket closed inside a frame")
            return None
        buf += chunk
    return bytes(buf)


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connected process's pid and uid."""
    pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(pid), int(uid)
