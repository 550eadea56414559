"""Host (RAM) tiers: a plain dict, or files in shared memory that same-host clients read in place."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from kvstore.block_format import HEADER_BYTES
from kvstore.shm import SHM_TOKEN_FILE, map_block_file, stage_block_file
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


def block_file_name(key: BlockHash) -> str:
    return key.hex()


class ShmHostTier(TierStorage):
    """One immutable file per block (header + payload) in a directory under /dev/shm.

    Files appear by rename (a reader sees a whole block or none) and go by unlink (a reader that
    already opened one keeps reading it whole). The directory is this server's alone and is
    removed on close.
    """

    tier = Tier.HOST

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex  # proves to a client that it sees this very dir
        (self.dir / SHM_TOKEN_FILE).write_text(self.token)
        self._keys: set[BlockHash] = set()

    @classmethod
    def create(cls, root: str = "/dev/shm") -> ShmHostTier:
        remove_stale_dirs(Path(root))
        return cls(Path(root) / f"kvserve-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def path(self, key: BlockHash) -> Path:
        return self.dir / block_file_name(key)

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        self.adopt(key, self.stage(payload, checksum, ephemeral=ephemeral, seq=seq))

    def stage(self, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int = 0) -> Path:
        """Writes a block file under a temporary name, for `adopt` (callers do this outside the
        store's lock: it is the copy)."""
        return self.dir / stage_block_file(self.dir, payload, checksum, ephemeral=ephemeral, seq=seq)

    def adopt(self, key: BlockHash, staged: Path) -> None:
        """Publishes a verified staged file (header + payload) as block `key`."""
        os.rename(staged, self.path(key))
        self._keys.add(key)

    def read(self, key: BlockHash) -> memoryview | None:
        """A read-only mapping of the payload (no copy); it stays valid if the block goes."""
        mapped = map_block_file(self.path(key))
        return None if mapped is None else mapped[0][HEADER_BYTES:]

    def delete(self, key: BlockHash) -> None:
        self._keys.discard(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def keys(self) -> set[BlockHash]:
        return set(self._keys)

    def close(self, timeout_s: float = 30.0) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._keys.clear()


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
