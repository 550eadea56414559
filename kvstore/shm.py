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

from kvstore.block_format import HEADER_BYTES, CorruptBlock, checksum, pack_header, unpack_header
from kvstore.types import Buffer

STAGED_NAME = re.compile(r"put-[0-9a-f]{32}\.tmp")
SHM_TOKEN_FILE = ".token"  # in the server's shm dir; its content is InfoResponse.shm_token


def host_id() -> str:
    """Equal for processes on the same machine (its boot id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def usable_dir(path: str, token: str) -> Path | None:
    """The server's shm dir if this process really shares it: the dir is accessible and holds
    the server's token (a same-named dir in another mount namespace, such as a container
    with its own /dev/shm on the same machine, does not)."""
    if not path or not token or not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return None
    try:
        seen = (Path(path) / SHM_TOKEN_FILE).read_text()
    except OSError:
        return None
    return Path(path) if seen == token else None


def stage_block_file(directory: Path, payload: Buffer, checksum: int, *, ephemeral: bool = False, seq: int = 0) -> str:
    """Writes a block (header + payload) as a new staged file in `directory`; returns its name."""
    name = f"put-{uuid.uuid4().hex}.tmp"
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.writev(fd, [pack_header(len(payload), checksum, ephemeral=ephemeral, seq=seq), payload])
    finally:
        os.close(fd)
    return name


def map_block_file(path: Path | str, *, populate: bool = False) -> tuple[memoryview, int] | None:
    """A read-only mapping of a whole block file (header + payload) and its inode, or None if it
    is absent, a symlink or shorter than a header. The mapping outlives an unlink of the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size < HEADER_BYTES:
            return None
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return memoryview(mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)), st.st_ino
    finally:
        os.close(fd)


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
            whole = self._map(name)
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

    def _map(self, name: str) -> memoryview | None:
        mapped = map_block_file(f"{self.dir}/{name}", populate=True)
        if mapped is None:
            return None
        whole, inode = mapped
        with self._lock:
            old = self._maps.pop(name, None)
            self._mapped -= 0 if old is None else len(old[1])
            self._maps[name] = (inode, whole)
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
