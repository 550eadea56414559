"""The paged KV cache: one preallocated tensor of fixed-size blocks. Which block holds what is kept by
engine.block_pool; this is only the memory."""

from __future__ import annotations

import math
import mmap
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.engine.model import Model

DEFAULT_CUDA_KV_CACHE_FRACTION = 0.5  # of the device memory free once the model is loaded


class KVCache:
    def __init__(
        self, num_blocks: int, *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [blocks, layers, 2, block_size, kv_heads, head_dim]: a block is one contiguous slot, in the
        # layout of a stored block (docs/DESIGN.md, "KV block format"), so moving it is one copy.
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self._map: mmap.mmap | None = None
        if torch.device(device).type == "cpu":
            # Anonymous memory, zero and untouched until a block is first written: the process holds the
            # blocks its pool has taken (engine.block_pool takes fresh ones last), not the pool's size.
            self._map = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
            with warnings.catch_warnings():  # torch warns that a buffer might not be writable: this one is
                warnings.simplefilter("ignore", UserWarning)
                self.kv = torch.frombuffer(self._map, dtype=dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.block_bytes = self.kv[0].nbytes
        self._bytes: memoryview | None = None  # the whole cache's bytes (slot_bytes)

    @property
    def releasable(self) -> bool:
        """Whether `release` gives memory back: a CPU cache, on Linux."""
        return self._map is not None and hasattr(mmap, "MADV_REMOVE")

    def release(self, num_blocks: int) -> None:
        """Gives the memory of the first ``num_blocks`` blocks back to the kernel (where `releasable`): they read as
        zeros, and take pages again as they are written. Only blocks nobody holds."""
        if self._map is not None and num_blocks and self.releasable:
            # A shared anonymous mapping is backed by shmem: MADV_DONTNEED would leave its pages in place.
            self._map.madvise(mmap.MADV_REMOVE, 0, min(num_blocks * self.block_bytes, len(self._map)))

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def layer(self, layer_idx: int, kind: int) -> torch.Tensor:
        """Keys (kind 0) or values (kind 1) of one layer: a view [blocks, block_size, kv_heads, head_dim]."""
        return self.kv[:, layer_idx, kind]

    def slot_bytes(self, block: int) -> memoryview:
        """The bytes of ``block``'s slot themselves (a CPU cache only): writing them writes the cache. A slice
        of one view of the whole cache, taken once: a view of a slot's tensor costs 7 us, 0.9 ms for a fetched
        prefix of 128 blocks."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} is not in a cache of {self.num_blocks}")
        if self._bytes is None:
            self._bytes = self.kv.view(-1).view(torch.uint8).numpy().data
        size = self.block_bytes
        return self._bytes[block * size : (block + 1) * size]

    def write(self, block: int, payload: memoryview | torch.Tensor, num_tokens: int) -> None:
        """Copy the raw bytes of ``num_tokens`` tokens of KV ([layers, 2, num_tokens, kv_heads, head_dim], the
        layout of a stored block; bytes, or a flat uint8 tensor on any device) into the first ``num_tokens``
        slots of ``block``: one copy."""
        if isinstance(payload, torch.Tensor):
            src = payload.view(self.kv.dtype)
        else:
            with warnings.catch_warnings():  # read-only source: torch warns that it may not write to it; it does not
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(payload, dtype=self.kv.dtype)
        dst = self.kv[block]  # [layers, 2, block_size, kv_heads, head_dim]
        if num_tokens == self.block_size:
            dst.view(-1).copy_(src)
        else:
            layers, _, _, heads, dim = dst.shape
            dst[:, :, :num_tokens].copy_(src.view(layers, 2, num_tokens, heads, dim))


DEFAULT_CPU_KV_CACHE_CAP = 1 << 30  # where the service gives no cap (kvserve.host.memory.memory_cap)


def default_kv_cache_memory(per_block: int, block_size: int, max_model_len: int | None, max_num_seqs: int,
                            cap: int | None) -> int:
    """--kv-cache-memory's default on CPU: the blocks of `max_num_seqs` sequences of `max_model_len` tokens, at
    most `cap` bytes (a service's share of the memory available, kvserve.host.memory.memory_cap), and at least one such
    sequence (a request the model takes must fit). Its memory is touched only as blocks are used (KVCache)."""
    share = DEFAULT_CPU_KV_CACHE_CAP if cap is None else cap
    if max_model_len is None:
        return share
    seq = (math.ceil(max_model_len / block_size) + 1) * per_block
    return max(seq, min(max_num_seqs * seq, share))


def kv_cache_blocks(model: Model, block_size: int, kv_cache_memory: int | None, max_num_seqs: int = 1,
                    cap: int | None = None) -> int:
    """Blocks that fit ``kv_cache_memory`` bytes (default: on CPU `default_kv_cache_memory` under ``cap``, on
    CUDA half the free device memory)."""
    per_block = KVCache.bytes_per_block(
        num_layers=model.num_layers, block_size=block_size, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=model.dtype,
    )
    if kv_cache_memory is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            kv_cache_memory = int(free * DEFAULT_CUDA_KV_CACHE_FRACTION)
        else:
            kv_cache_memory = default_kv_cache_memory(per_block, block_size, model.max_positions, max_num_seqs, cap)
    blocks = kv_cache_memory // per_block
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {kv_cache_memory} bytes holds no block of {per_block} bytes")
    return blocks
