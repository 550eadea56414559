"""Host (RAM) tiers: a plain dict, or an arena in shared memory that same-host clients map."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from kvstore.arena import SOCKET_NAME, Arena, ArenaSocket
from kvstore.block_format import checksum
from kvstore.tier import ArenaTier, TierStorage
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


class ArenaHostTier(ArenaTier):
    """Blocks in slots of a shared-memory arena that same-host clients map (kvstore/arena.py).

    The arena is anonymous shared memory; this server's dir under /dev/shm holds only the socket
    that hands it out, and is removed on close.
    """

    tier = Tier.HOST

    def __init__(self, directory: Path, capacity: int) -> None:
        self.arena = Arena(capacity)
        super().__init__(directory, self.arena.size)
        self.socket = ArenaSocket(self.arena, self.dir / SOCKET_NAME)

    @classmethod
    def create(cls, capacity: int, root: str = "/dev/shm") -> ArenaHostTier:
        return cls(new_shm_dir(root), capacity)

    def slot_checksum(self, offset: int, size: int) -> int:
        return checksum(self.arena.view[offset : offset + size])

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        offset = self._alloc(len(payload))
        self.arena.view[offset : offset + len(payload)] = payload
        self._slots[key] = (offset, len(payload), checksum)

    def copy_slot(self, offset: int, size: int, checksum_: int) -> bytes | None:
        payload = bytes(self.arena.view[offset : offset + size])
        return payload if checksum(payload) == checksum_ else None

    def close(self, timeout_s: float = 30.0) -> None:
        super().close(timeout_s)
        with contextlib.suppress(BufferError):  # a reader still copying: the mapping goes at exit
            self.arena.close()


def new_shm_dir(root: str) -> Path:
    """A private dir for this server's arena socket under `root`, after removing dead servers' dirs."""
    remove_stale_dirs(Path(root))
    return Path(root) / f"kvserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"


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
