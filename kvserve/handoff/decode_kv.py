"""Decode's side of the hand-off: where a sequence's KV comes from beyond decode's own pool, and
where it goes (docs/DESIGN.md, "Request flow", steps 6 and 8).

Loading: the prompt's full blocks from the store under the handle's keys, then, on the first
admission only, the prompt's partial tail. A block that is missing or fails verification is a miss
(docs/DESIGN.md, "Failure policy"): what follows it is recomputed by the engine. Saving: full blocks
of a preempted sequence, so that it resumes from the store; and the blocks of its generated tokens,
each as it fills (the engine saves them then) and the rest when it finishes, so that the next turn
of a chat hits the cache on the reply too, and a replica that continues the stream after this one
died finds them (with the prefix cache off, only a preempted sequence's blocks are kept, under
request-private keys).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import abc

import torch

from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.sequence import Sequence, Status
from kvserve.handoff.codec import BlockError
from kvserve.handoff.requests import PrefillHandle
from kvserve.handoff.session import StoreSession
from kvserve.handoff.transfer import load_blocks, save_blocks
from protos.block_hash import BlockHash


class DecodeKV:
    """``prompt_keys`` key the prompt's full blocks in the store when they are not prefix hashes (the
    prefix cache off); ``tail`` is (key, length) of its partial last block when one was stored; the
    ``leases`` (decode's own lookup's, prefill's) pin the prompt's blocks until they are loaded."""

    def __init__(self, store: StoreSession, namespace: Namespace, num_prompt_tokens: int, cacheable: bool, *,
                 prompt_keys: abc.Sequence[BlockHash] = (), tail: tuple[BlockHash, int] | None = None,
                 leases: abc.Iterable[str] = ()) -> None:
        self.store = store
        self.namespace = namespace
        self.cacheable = cacheable
        self.leases: list[str] = []
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_keys = list(prompt_keys)
        self.tail = tail
        self._private_root = BlockHash(hashlib.sha256(b"kvserve/decode-private\x00" + os.urandom(32)).digest())
        self._lock = threading.Lock()
        self.num_stored = 0
        self.error: BlockError | None = None
        for lease in leases:
            self.hold(lease)

    @classmethod
    def from_handle(cls, store: StoreSession, namespace: Namespace, handle: PrefillHandle, cacheable: bool,
                    leases: abc.Iterable[str] = ()) -> DecodeKV:
        """The KV prefill left in the store under the handle's keys, pinned by the handle's lease and ``leases``."""
        num_full, tail_len = divmod(len(handle.prompt_token_ids), namespace.block_size)
        # A malformed handle (keys for another number of blocks): trust none of its keys.
        valid = len(handle.block_hashes) == num_full
        tail = (handle.tail_key, tail_len) if valid and tail_len and handle.tail_key is not None else None
        return cls(store, namespace, len(handle.prompt_token_ids), cacheable,
                   prompt_keys=handle.block_hashes if valid else (), tail=tail, leases=[*leases, handle.lease_id])

    def keys(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Store keys of the sequence's first ``num_blocks`` full blocks."""
        bs = self.namespace.block_size
        if self.cacheable:
            return seq.full_block_hashes(bs, num_blocks)
        keys = self.prompt_keys[:num_blocks]
        if (have := len(keys)) < num_blocks:  # private blocks past the prompt chain on from its last key
            keys += prefix_hashes(seq.token_ids[have * bs : num_blocks * bs], bs, keys[-1] if keys else self._private_root)
        return keys

    def hold(self, lease_id: str) -> None:
        """Keep ``lease_id`` (none if empty) until `release_leases`."""
        with self._lock:
            if lease_id and lease_id not in self.leases:
                self.leases.append(lease_id)

    def take_leases(self) -> list[str]:
        """The leases held, now the caller's to release."""
        with self._lock:
            leases, self.leases = self.leases, []
        return leases

    def release_leases(self) -> None:
        """Let go of the prompt's leases (once each): decode has its blocks, or will not fetch them."""
        for lease in self.take_leases():
            self.store.release(lease)

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        bs = self.namespace.block_size
        num_full = min(seq.num_saved_blocks, (len(seq.token_ids) - 1) // bs)
        first_admission = len(seq.token_ids) == self.num_prompt_tokens + 1
        tail = self.tail if first_admission and num_full == self.num_prompt_tokens // bs else None
        loaded = load_blocks(self.store, self.keys(seq, num_full)[first_block:], self.namespace, cache, blocks, tail)
        self.release_leases()
        self.error = loaded.error or self.error
        return loaded.num_tokens

    def save(self, seq: Sequence, first_block: int, kv: abc.Sequence[torch.Tensor], num_tokens: int) -> None:
        if not self.cacheable and seq.status is Status.FINISHED:
            return
        num_full = first_block + num_tokens // self.namespace.block_size
        self.num_stored += save_blocks(self.store, self.keys(seq, num_full)[first_block:], self.namespace, kv,
                                       num_tokens, ephemeral=not self.cacheable)
