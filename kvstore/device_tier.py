"""Device tier: blocks in slots of one uint8 buffer in GPU memory (or CPU memory, so its logic is
tested here), allocated once and carved by the same slab allocator as the host arena.

The only module of kvstore that imports torch.
"""

from __future__ import annotations

import warnings

import torch

from kvstore.slab import SlabAllocator
from kvstore.tier import TierStorage
from kvstore.types import Buffer, Tier
from protos.block_hash import BlockHash


class DeviceTier(TierStorage):
    tier = Tier.DEVICE

    def __init__(self, capacity: int, device: str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available; use --device cpu or off")
        self.slots = SlabAllocator(capacity)
        self.buffer = torch.empty(self.slots.size, dtype=torch.uint8, device=self.device)  # [bytes]
        self._blocks: dict[BlockHash, tuple[int, int]] = {}  # key -> (offset, size)

    def has_room(self, size: int) -> bool:
        return self.slots.has_room(size)

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        offset = self.slots.alloc(len(payload))
        if offset is None:  # the store checks has_room first
            raise MemoryError(f"no free device slot for {len(payload)} bytes")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on read-only bytes; we copy at once
            src = torch.frombuffer(payload, dtype=torch.uint8)
        self.buffer[offset : offset + len(payload)].copy_(src)
        self._blocks[key] = (offset, len(payload))

    def read(self, key: BlockHash) -> bytes | None:
        found = self._blocks.get(key)
        if found is None:
            return None
        offset, size = found
        return self.buffer[offset : offset + size].cpu().numpy().tobytes()

    def delete(self, key: BlockHash) -> None:
        found = self._blocks.pop(key, None)
        if found is not None:
            self.slots.free(found[0])

    def keys(self) -> set[BlockHash]:
        return set(self._blocks)
