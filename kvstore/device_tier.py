"""Device tier: blocks as uint8 tensors in GPU memory (or CPU tensors, so its logic is tested here).

The only module of kvstore that imports torch.
"""

from __future__ import annotations

import warnings

import torch

from kvstore.tier import TierStorage
from kvstore.types import Buffer, Tier
from protos.block_hash import BlockHash


class DeviceTier(TierStorage):
    tier = Tier.DEVICE

    def __init__(self, device: str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available; use --device cpu or off")
        self._blocks: dict[BlockHash, torch.Tensor] = {}

    def write(self, key: BlockHash, payload: Buffer, checksum: int, *, ephemeral: bool, seq: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer on read-only bytes; we copy at once
            src = torch.frombuffer(payload, dtype=torch.uint8)
        block = torch.empty(len(payload), dtype=torch.uint8, device=self.device)  # [bytes]
        block.copy_(src)
        self._blocks[key] = block

    def read(self, key: BlockHash) -> bytes | None:
        block = self._blocks.get(key)
        if block is None:
            return None
        return block.cpu().numpy().tobytes()

    def delete(self, key: BlockHash) -> None:
        self._blocks.pop(key, None)

    def keys(self) -> set[BlockHash]:
        return set(self._blocks)
