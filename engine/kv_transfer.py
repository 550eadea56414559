"""Moving a sequence's KV between the pool and a block store (the KV store, through the services'
best-effort session): verified blocks are copied straight into pool slots, and pool slots are
encoded straight into stored blocks (DESIGN.md, "KV block format")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.hashing import Namespace
from engine.kv_codec import BlockError, encode_block, verify_block
from engine.kv_pool import KVPool
from protos.block_hash import BlockHash


class BlockStore(Protocol):
    """What the engine needs of a store; a miss or a failure is None, never an exception."""

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]: ...

    def put(self, blocks: Iterable[tuple[BlockHash, bytes]], ephemeral: bool = False) -> int: ...


@dataclass(frozen=True, slots=True)
class Loaded:
    num_tokens: int  # leading tokens now in the pool
    error: BlockError | None = None  # the bad block that ended the run, if one did


def load_blocks(
    store: BlockStore, keys: Sequence[BlockHash], namespace: Namespace, pool: KVPool, blocks: Sequence[int],
    tail: tuple[BlockHash, int] | None = None,
) -> Loaded:
    """Fetch full blocks ``keys`` (then the partial ``tail`` (key, tokens) once every full one is there)
    into pool ``blocks``, in order, up to the first miss or bad block: a bad block is a miss, and
    nothing after it is used, since a prefix must be contiguous."""
    keys = list(keys[: len(blocks)])
    with_tail = tail is not None and len(blocks) > len(keys)
    payloads = store.get(keys + [tail[0]] if with_tail and tail else keys)
    _, layers, _, _, heads, dim = pool.kv.shape
    bs, done = pool.block_size, 0
    for i, payload in enumerate(payloads):
        if payload is None:
            break
        num_tokens = bs if i < len(keys) else tail[1]  # type: ignore[index]
        try:
            body, _ = verify_block(payload, namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim,
                                   dtype=pool.kv.dtype, num_tokens=num_tokens)
        except BlockError as exc:
            return Loaded(done, exc)
        pool.write(blocks[i], body, num_tokens)
        done += num_tokens
    return Loaded(done)


def save_blocks(
    store: BlockStore, keys: Sequence[BlockHash], namespace: Namespace, kv: torch.Tensor, num_tokens: int,
    tail_key: BlockHash | None = None, ephemeral: bool = False,
) -> int:
    """Put the full blocks of ``kv`` [blocks, layers, 2, block_size, kv_heads, head_dim] (``num_tokens``
    tokens) under ``keys``, and a partial last block under ``tail_key`` if given (always ephemeral);
    returns how many blocks the store took."""
    bs = kv.shape[3]
    num_full = num_tokens // bs
    stored = store.put([(key, encode_block(kv[i], namespace)) for i, key in enumerate(keys[:num_full])],
                       ephemeral=ephemeral)
    if tail_key is not None and num_tokens % bs:
        stored += store.put([(tail_key, encode_block(kv[num_full, :, :, : num_tokens % bs], namespace))],
                            ephemeral=True)
    return stored
