"""A client's opening of a store's arena (kvstore/arena.py): its same-host channel, and the segment that
copies blocks out of slots and into them: the host arena's shared memory here, a device arena's by the
device tier (kvstore/device_tier.py, which loads torch only for a device arena)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import xxhash

from kvstore.arena import (
    GET,
    GREETING,
    MAX_GREETING,
    PUT,
    RESERVE,
    SEALS,
    STATUSES,
    LocalCallError,
    recv_frame,
    send_frame,
    unix_address,
)
from kvstore.types import Buffer, Part, fill


class ChannelBusy(TimeoutError):
    """A call that waited its whole timeout for another thread's call on the channel to end: the store is not
    answering, and that call, when it times out, closes the channel (closing it now would break that call
    first, as if the channel had failed)."""


class ArenaMap:
    """A client's opening of a store's arena: its same-host channel, and the `segment` that copies blocks
    out of slots and into them (a HostSegment, or a device arena's OpenedSegment)."""

    def __init__(self, socket_path: Path | str, timeout_s: float = 2.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()
        fds: list[int] = []
        try:
            self._sock.settimeout(timeout_s)
            with unix_address(socket_path) as address:
                self._sock.connect(address)
            msg, fds, _, _ = socket.recv_fds(self._sock, MAX_GREETING, 1)
            if not msg.startswith(GREETING):
                raise OSError(f"{socket_path} is not a kvserve arena socket")
            try:
                fields = json.loads(msg[len(GREETING) :])
            except ValueError:
                raise OSError(f"{socket_path} sent a garbled greeting") from None
            self.segment = open_segment(fields, fds)
        except BaseException:
            self._sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self.size = self.segment.size
        self.methods = frozenset(fields.get("methods", (GET, RESERVE, PUT)))  # a store before Lookup's names none
        self._broken: type[OSError] | None = None  # why the channel closed under a call: TimeoutError, or OSError
        self._closing = threading.Lock()  # taken by the first close, never given back

    def call(self, method: int, body: bytes, timeout_s: float) -> bytes:
        """One call on the same-host channel; LocalCallError if the store refused it, TimeoutError if it did not
        answer within `timeout_s` (the wait for another thread's call on the channel included), OSError if the
        channel broke. A call that fails once its request is out closes the channel for good: a reply that
        came late would be read as the answer to the next call. The calls that waited for it then fail as it
        did, at once."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            raise ChannelBusy(f"another call on the store's arena channel went unanswered for {timeout_s:g} s")
        try:
            if self._broken is not None:
                raise self._broken("the store's arena channel closed when an earlier call on it failed")
            self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                send_frame(self._sock, method, body)
                reply = recv_frame(self._sock)
                if reply is None:
                    raise OSError("the store closed its arena socket")
            except OSError as exc:
                self._broken = TimeoutError if isinstance(exc, TimeoutError) else OSError
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                raise
        finally:
            self._lock.release()
        status, payload = reply
        if status:
            name = STATUSES[status] if status < len(STATUSES) else "UNKNOWN"
            raise LocalCallError(name, payload.decode(errors="replace"))
        return payload

    def close(self) -> None:
        if self._closing.acquire(blocking=False):  # once: a device segment counts the clients that hold it
            self._sock.close()
            self.segment.close()


class Segment(Protocol):
    """A client's copies into and out of an arena's slots, each checked with the arena's kind of checksum."""

    size: int

    def read(self, offset: int, size: int, checksum: int) -> bytes | None:
        """A copy of the slot's `size` bytes if they match `checksum`, else None."""

    def read_into(self, offset: int, size: int, checksum: int, out: Sequence[Part]) -> bool:
        """Copies the slot's `size` bytes into the buffers `out`, in order (e.g. a block's header into one
        and its tensor straight into a KV pool slot); True if they match `checksum`."""

    def write_many(self, offsets: Sequence[int], blocks: Sequence[Sequence[Buffer]]) -> list[int]:
        """Copies each block's parts one after another into the slot at its offset; their checksums."""

    def close(self) -> None: ...


def open_segment(fields: dict[str, Any], fds: list[int]) -> Segment:
    """The client's side of an arena, from the greeting's description."""
    if fields.get("kind") == "memfd":
        if len(fds) != 1:
            raise OSError("a shared-memory arena comes with one file descriptor")
        return HostSegment(fds[0])
    from kvstore.device_tier import open_device_segment  # torch only for a device arena

    return open_device_segment(fields, fds)


class HostSegment:
    """A mapping of the host arena's segment; blocks are checked with xxh3, as the store keeps them."""

    def __init__(self, fd: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise OSError("the store's arena is not sealed against resizing: not mapping it")
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)  # (populated, it would take every page)
        self.view = memoryview(self._map)

    def read(self, offset: int, size: int, checksum: int) -> bytes | None:
        if offset < 0 or offset + size > self.size:
            return None
        payload = bytes(self.view[offset : offset + size])
        return payload if xxhash.xxh3_64_intdigest(payload) == checksum else None

    def read_into(self, offset: int, size: int, checksum: int, out: Sequence[Part]) -> bool:
        if offset < 0 or offset + size > self.size or size > sum(len(b) for b in out):
            return False
        hasher = xxhash.xxh3_64()
        for buf in out:
            n = min(len(buf), size)
            hasher.update(fill(buf, self.view[offset : offset + n]))  # hashed while still in cache
            offset, size = offset + n, size - n
        return hasher.intdigest() == checksum

    def write(self, offset: int, parts: Sequence[Buffer]) -> int:
        # Hashed from the copy while it is still in cache: a fraction of the cost of hashing apart.
        if offset < 0 or offset + sum(len(p) for p in parts) > self.size:
            raise ValueError(f"slot at {offset} lies outside the arena")
        hasher = xxhash.xxh3_64()
        for part in parts:
            dest = self.view[offset : offset + len(part)]
            dest[:] = part
            hasher.update(dest)
            offset += len(part)
        return hasher.intdigest()

    def write_many(self, offsets: Sequence[int], blocks: Sequence[Sequence[Buffer]]) -> list[int]:
        return [self.write(offset, parts) for offset, parts in zip(offsets, blocks, strict=True)]

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # another thread is copying: the mapping goes with it
            self.view.release()
            self._map.close()
