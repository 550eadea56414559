"""Prefix hashing of token blocks (docs/DESIGN.md, "Prefix hashing").

``h[i] = sha256(h[i-1] || uint32-LE token ids of block i)``, with ``h[-1]`` the root of the
namespace. No randomness and no Python ``hash()``: every process on every machine computes the
same hashes for the same tokens and namespace.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from protos.block_hash import HASH_BYTES, BlockHash

BLOCK_FORMAT_VERSION = 2  # of the KV block layout (handoff.codec); a change makes new hashes
# 1: [layers, 2, kv_heads, tokens, head_dim]; 2: token-major [layers, 2, tokens, kv_heads, head_dim]
_NAMESPACE_DOMAIN = b"kvserve/namespace\x00"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that decides whether two KV blocks are interchangeable."""

    model_fingerprint: str
    kv_dtype: str
    block_size: int
    cache_salt: str = ""
    format_version: int = BLOCK_FORMAT_VERSION
    _root: BlockHash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        # Computed once: every block encoded or decoded names its namespace.
        object.__setattr__(self, "_root", self._compute_root())

    def root(self) -> BlockHash:
        """sha256 of the canonical (sorted-key, compact, UTF-8) JSON encoding of the namespace."""
        return self._root

    def _compute_root(self) -> BlockHash:
        canonical = json.dumps(
            {
                "block_size": self.block_size,
                "cache_salt": self.cache_salt,
                "format_version": self.format_version,
                "kv_dtype": self.kv_dtype,
                "model_fingerprint": self.model_fingerprint,
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8")
        return BlockHash(hashlib.sha256(_NAMESPACE_DOMAIN + canonical).digest())


def _pack_uint32_le(token_ids: Sequence[int]) -> bytes:
    try:
        packed = array("I", token_ids)
    except OverflowError as e:
        raise ValueError("token ids must be in [0, 2**32)") from e
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _check_parent(parent: bytes) -> None:
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")


def prefix_hashes(token_ids: Sequence[int], block_size: int, parent: BlockHash) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``token_ids``; a trailing partial block gets none. The first
    block chains on ``parent``: the namespace root, or the hash of the block before ``token_ids[0]``."""
    _check_parent(parent)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    packed = memoryview(_pack_uint32_le(token_ids[: num_blocks * block_size]))
    stride = 4 * block_size
    hashes: list[BlockHash] = []
    for start in range(0, num_blocks * stride, stride):
        h = hashlib.sha256(parent)
        h.update(packed[start : start + stride])
        parent = BlockHash(h.digest())
        hashes.append(parent)
    return hashes


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash (the namespace root for the first block)."""
    (block_hash,) = prefix_hashes(token_ids, len(token_ids), parent)
    return block_hash
