"""Host (RAM) tiers: a plain dict, or an arena in shared memory that same-host clients map."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from kvstore.arena import SOCKET_NAME, Arena, ArenaSocket
from kvstore.block_format import CorruptBlock, checksum
from kvstore.tier import TierStorage
from kvstore.types import Buffer, Tier
from protos.block_hash import BlockHash


class MemoryHostTier(TierStorage):
    """Blocks as bytes objects in a dict: reads are O(1) and copy nothing."""

    tier = Tier.HOST

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, bytes] = {}

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        self._blocks[key] = bytes(payload)

    def read(self, key: BlockHash) -> bytes | None:
        return self._blocks.get(key)

    def delete(self, key: BlockHash) -> None:
        self._blocks.pop(key, None)

    def keys(self) -> set[BlockHash]:
        return set(self._blocks)


class ArenaHostTier(TierStorage):
    """Blocks in slots of a shared-memory arena that same-host clients map (kvstore/arena.py).

    The arena is anonymous shared memory; this server's dir under /dev/shm holds only the socket
    that hands it out, and is removed on close.
    """

    tier = Tier.HOST

    def __init__(self, directory: Path, capacity: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.arena = Arena(capacity)
        self.socket = ArenaSocket(self.arena, self.dir / SOCKET_NAME)
        self._slots: dict[BlockHash, tuple[int, int, int]] = {}  # key -> (offset, size, checksum)

    @classmethod
    def create(cls, capacity: int, root: str = "/dev/shm") -> ArenaHostTier:
        remove_stale_dirs(Path(root))
        return cls(Path(root) / f"kvserve-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity)

    def has_room(self, size: int) -> bool:
        return self.arena.slots.has_room(size)

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        offset = self.arena.slots.alloc(len(payload))
        if offset is None:  # the store checks has_room first
            raise MemoryError(f"no free arena slot for {len(payload)} bytes")
        self.arena.view[offset : offset + len(payload)] = payload
        self._slots[key] = (offset, len(payload), checksum)

    def reserve(self, size: int) -> int | None:
        """A slot for a client to fill before `adopt`, or None."""
        return self.arena.slots.alloc(size)

    def release(self, offset: int) -> None:
        self.arena.slots.free(offset)

    def adopt(self, key: BlockHash, offset: int, size: int, checksum: int) -> None:
        """Makes a reserved slot, filled by a client, block `key` (no copy)."""
        self._slots[key] = (offset, size, checksum)

    def slot(self, key: BlockHash) -> tuple[int, int] | None:
        """(offset, size) of the block's slot, for a same-host client to copy from."""
        found = self._slots.get(key)
        return None if found is None else found[:2]

    def read(self, key: BlockHash) -> bytes | None:
        """A verified copy (the slot may be reused once the block goes). Raises CorruptBlock when
        the slot still holds the block but its bytes changed (another process wrote there)."""
        found = self._slots.get(key)
        if found is None:
            return None
        offset, size, csum = found
        payload = bytes(self.arena.view[offset : offset + size])
        if checksum(payload) == csum:
            return payload
        if self._slots.get(key) == found:
            raise CorruptBlock(f"arena slot at {offset} no longer holds block {key.hex()[:16]}")
        return None  # moved meanwhile

    def delete(self, key: BlockHash) -> None:
        found = self._slots.pop(key, None)
        if found is not None:
            self.arena.slots.free(found[0])

    def keys(self) -> set[BlockHash]:
        return set(self._slots)

    def close(self, timeout_s: float = 30.0) -> None:
        self.socket.close()
        self._slots.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(BufferError):  # a reader still copying: the mapping goes at exit
            self.arena.close()


def remove_stale_dirs(root: Path) -> None:
    """Removes shm dirs left by kvstore processes of this user that died without cleaning up."""
    for d in root.glob("kvserve-*-*"):
        try:
            pid = int(d.name.split("-")[1])
            if d.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, OSError):
            continue
