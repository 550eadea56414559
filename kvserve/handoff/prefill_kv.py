"""Prefill's side of the hand-off: the store's leading hits into the pool, what prefill computed back out,
the prompt's partial tail under a key no other request can name."""

from __future__ import annotations

import hashlib
import os
import time
from collections import abc

import torch

from kvserve.engine.hashing import Namespace
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.sequence import Sequence, Status
from kvserve.handoff.codec import BlockError
from kvserve.handoff.session import StoreSession
from kvserve.handoff.transfer import load_blocks, save_blocks
from protos.block_hash import BlockHash


def request_scoped_keys(root: BlockHash, request_id: str, num_blocks: int) -> tuple[list[BlockHash], BlockHash]:
    """Random 32-byte keys for one request's blocks and tail: no other request can name them."""
    base = hashlib.sha256(b"kvserve/request\x00" + root + os.urandom(16) + request_id.encode()).digest()
    blocks = [BlockHash(hashlib.sha256(base + b"block" + i.to_bytes(4, "little")).digest()) for i in range(num_blocks)]
    return blocks, BlockHash(hashlib.sha256(base + b"tail").digest())


class PrefillKV:
    """Prefill's side of the store for one prompt: the store's leading hits are loaded into the pool,
    and what was computed here is saved back (full blocks under their keys, the partial tail under a
    request-scoped key for decode)."""

    def __init__(self, store: StoreSession, namespace: Namespace, keys: list[BlockHash], tail_key: BlockHash,
                 ephemeral: bool) -> None:
        self.store = store
        self.namespace = namespace
        self.keys = keys
        self.tail_key = tail_key
        self.ephemeral = ephemeral
        self.fetch_s = 0.0
        self.put_s = 0.0
        self.num_stored = 0
        self.tail_stored = False
        self.error: BlockError | None = None

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        t = time.perf_counter()
        loaded = load_blocks(self.store, self.keys[first_block : seq.num_saved_blocks], self.namespace, cache, blocks)
        self.error = loaded.error or self.error
        self.fetch_s += time.perf_counter() - t
        return loaded.num_tokens

    def save(self, seq: Sequence, first_block: int, kv: abc.Sequence[torch.Tensor], num_tokens: int) -> None:
        t = time.perf_counter()
        finished = seq.status is Status.FINISHED  # else preempted: its tail is recomputed, not stored
        self.num_stored += save_blocks(self.store, self.keys[first_block:], self.namespace, kv, num_tokens,
                                       self.tail_key if finished else None, ephemeral=self.ephemeral)
        self.tail_stored = finished and num_tokens % self.namespace.block_size != 0 and not self.store.failed
        self.put_s += time.perf_counter() - t
