"""Same-host fast path: who shares this machine, and block files read or staged in place.

A block file is `block_format` header + payload. The server's shm tier publishes one per block
(name = hash hex); a same-host client stages puts as `put-<32 hex>.tmp` files in the same dir.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path

from kvstore.block_format import HEADER_BYTES, CorruptBlock, pack_header, unpack_header, verify

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


def read_block_file_into(path: Path, out: memoryview) -> int | None:
    """Reads a verified payload into `out` (no allocation); its size, or None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        header = unpack_header(os.read(fd, HEADER_BYTES))
        if header.size > len(out):
            return None
        dest = out[: header.size]
        got = os.readv(fd, [dest])
        verify(header, dest[:got])
    except CorruptBlock:
        return None
    finally:
        os.close(fd)
    return header.size


def stage_block_file(directory: Path, payload: bytes, checksum: int) -> str:
    """Writes a block as a staged file for a same-host put; returns its name."""
    name = f"put-{uuid.uuid4().hex}.tmp"
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.writev(fd, [pack_header(len(payload), checksum), payload])
    finally:
        os.close(fd)
    return name
