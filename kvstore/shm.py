"""Same-host fast path: who shares this machine, and block files read or staged in place.

A block file is `block_format` header + payload. The server's shm tier publishes one per block
(name = hash hex); a same-host client stages puts as `put-<32 hex>.tmp` files in the same dir.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from kvstore.block_format import HEADER_BYTES, CorruptBlock, checksum, pack_header, unpack_header, verify

STAGED_NAME = re.compile(r"put-[0-9a-f]{32}\.tmp")


def host_id() -> str:
    """Equal for processes on the same machine (its boot id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def usable_dir(path: str) -> Path | None:
    """The server's shm dir if this process can use it (same machine and mount, permissions)."""
    if not path or not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return None
    return Path(path)


def read_block_file(path: Path, expected_checksum: int | None = None) -> bytes | None:
    """A verified payload (one copy from the page cache), or None if absent or damaged."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        header = unpack_header(os.read(fd, HEADER_BYTES))
        payload = os.read(fd, header.size)
        verify(header, payload)
    except CorruptBlock:
        return None
    finally:
        os.close(fd)
    if expected_checksum is not None and header.checksum != expected_checksum:
        return None
    return payload


def stage_block_file(directory: Path, payload: bytes, checksum: int) -> str:
    """Writes a block as a staged file for a same-host put; returns its name."""
    name = f"put-{uuid.uuid4().hex}.tmp"
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.writev(fd, [pack_header(len(payload), checksum), payload])
    finally:
        os.close(fd)
    return name


class ShmReader:
    """Reads a server's shm block files through cached read-only mappings (client side).

    A block file is immutable while it exists, so a mapping stays valid for as long as the path
    still names the same inode (checked with one stat per read); a replaced or removed file is
    unmapped. After the first read of a block, a read is a verified user-space memcpy instead of
    a kernel copy page by page. At most `max_mapped_bytes` stay mapped (least recently used go).
    """

    def __init__(self, directory: Path, max_mapped_bytes: int = 1 << 30) -> None:
        self.dir = str(directory)
        self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: OrderedDict[str, tuple[int, memoryview]] = OrderedDict()  # name -> (inode, whole file)
        self._mapped = 0
        self._lock = threading.Lock()

    def read(self, name: str, expected_checksum: int | None = None) -> bytes | None:
        """A verified copy of the payload, or None if absent or damaged."""
        found = self._locate(name, expected_checksum)
        if found is None:
            return None
        view, csum = found
        payload = bytes(view)
        if checksum(payload) != csum:
            self._forget(name)
            return None
        return payload

    def read_into(self, name: str, out: memoryview) -> int | None:
        """Copies a payload into `out` and verifies it there; its size, or None."""
        found = self._locate(name, None)
        if found is None or len(found[0]) > len(out):
            return None
        view, csum = found
        dest = out[: len(view)]
        dest[:] = view
        if checksum(dest) != csum:
            self._forget(name)
            return None
        return len(view)

    def _locate(self, name: str, expected_checksum: int | None) -> tuple[memoryview, int] | None:
        # The copy is verified, not the mapping: hashing the copy while it is hot in cache costs
        # less memory bandwidth, and it checks exactly the bytes handed out.
        try:
            inode = os.stat(name, dir_fd=self._dir_fd).st_ino
        except OSError:  # gone, or this reader was closed
            self._forget(name)
            return None
        with self._lock:
            cached = self._maps.get(name)
            if cached is not None and cached[0] == inode:
                self._maps.move_to_end(name)
                whole = cached[1]
            else:
                whole = None
        if whole is None:
            whole = self._map(name, f"{self.dir}/{name}")
            if whole is None:
                return None
        try:
            header = unpack_header(whole)
        except CorruptBlock:
            self._forget(name)
            return None
        if HEADER_BYTES + header.size != len(whole):
            self._forget(name)
            return None
        if expected_checksum is not None and header.checksum != expected_checksum:
            return None
        return whole[HEADER_BYTES:], header.checksum

    def _map(self, name: str, path: str) -> memoryview | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size < HEADER_BYTES:
                return None
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            whole = memoryview(mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
        with self._lock:
            old = self._maps.pop(name, None)
            self._mapped -= 0 if old is None else len(old[1])
            self._maps[name] = (st.st_ino, whole)
            self._mapped += len(whole)
            while self._mapped > self.max_mapped_bytes and len(self._maps) > 1:
                _, (_, dropped) = self._maps.popitem(last=False)
                self._mapped -= len(dropped)  # unmapped once no caller holds a view of it
        return whole

    def _forget(self, name: str) -> None:
        with self._lock:
            old = self._maps.pop(name, None)
            if old is not None:
                self._mapped -= len(old[1])

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
            self._mapped = 0
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1
