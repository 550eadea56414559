"""Moving a sequence's KV between the KV cache and a store (the KV store, through the services'
best-effort session): verified blocks are copied straight into cache slots, and cache slots are
encoded straight into stored blocks (docs/DESIGN.md, "KV block format").

Where the store's top tier is a device arena this process has opened (same node), blocks move device
to device, a batch at a time: a put copies cache slots into arena slots, a get copies arena slots into
cache slots, and only the 64-byte headers cross to the host. A cache on a GPU without such a store moves
its blocks through host memory, in one copy per direction for the whole batch.

A block rejected on load (bad checksum, header, shape or namespace, or NaN/infinite values) is
removed from the store, so the block the engine computes in its place is stored by the next put
(the store keeps the first write of a hash otherwise): no bad block sticks."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvserve.engine import native
from kvserve.engine.hashing import Namespace
from kvserve.engine.kv_cache import KVCache
from kvserve.handoff.codec import (
    HEADER_BYTES,
    BlockError,
    check_header,
    encode_header,
    encode_parts,
    verify_block,
)
from kvstore import Part
from protos.block_hash import BlockHash

log = logging.getLogger(__name__)

EncodedBlock = bytes | tuple[bytes, memoryview]  # a block, or its header and a view of its tensor


def encoded_bytes(block: EncodedBlock) -> bytes:
    """An encoded block as one bytes object (for stores that keep bytes)."""
    return block if isinstance(block, bytes) else b"".join(block)


class KVStoreLike(Protocol):
    """What the engine needs of the KV store (its client, the services' store session, a dict in tests);
    a miss or a failure is None, never an exception."""

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]: ...

    def put(self, blocks: Iterable[tuple[BlockHash, EncodedBlock]], ephemeral: bool = False) -> int: ...

    def remove(self, hashes: Sequence[BlockHash]) -> int:
        """Drops blocks the engine found bad; returns how many the store held."""
        ...


@runtime_checkable
class ScatterStore(KVStoreLike, Protocol):
    """A store that copies blocks straight into caller buffers, verified against its own checksum
    (the KV store's client): a block then lands in its cache slot in one copy and one hash pass."""

    def get_into(self, hashes: Sequence[BlockHash], buffers: Sequence[Sequence[Part]]) -> list[int | None]: ...


MOVE_BYTES = 64 << 20  # blocks move between a GPU cache and the store this many bytes a call (scratch on the device)


@runtime_checkable
class TensorStore(KVStoreLike, Protocol):
    """A store that moves blocks as tensors (the KV store's client): device to device when
    ``tensor_device`` names the device of a store arena this process opened, else through host bytes."""

    def tensor_device(self) -> torch.device | None: ...

    def get_tensors(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]: ...

    def put_tensors(self, blocks: Iterable[tuple[BlockHash, Sequence[torch.Tensor | bytes]]],
                    ephemeral: bool = False) -> int: ...


def _device_path(store: KVStoreLike, cache_device: torch.device) -> bool:
    """Blocks go as tensors: the store holds them in a device arena this process opened, or the cache is on
    a GPU (where memoryviews of its slots cannot be had)."""
    return isinstance(store, TensorStore) and (store.tensor_device() is not None or cache_device.type != "cpu")


@dataclass(frozen=True, slots=True)
class Loaded:
    num_tokens: int  # leading tokens now in the cache
    error: BlockError | None = None  # the bad block that ended the run, if one did
    rejected: tuple[BlockHash, ...] = ()  # bad blocks seen, removed from the store


def load_blocks(
    store: KVStoreLike, keys: Sequence[BlockHash], namespace: Namespace, cache: KVCache, blocks: Sequence[int],
    tail: tuple[BlockHash, int] | None = None, *, move_bytes: int = MOVE_BYTES,
) -> Loaded:
    """Fetch full blocks ``keys`` (then the partial ``tail`` (key, tokens) once every full one is there)
    into cache ``blocks``, in order, up to the first miss or bad block: a bad block is a miss, and
    nothing after it is used, since a prefix must be contiguous. Blocks moved as tensors go
    ``move_bytes`` at a time."""
    keys = list(keys[: len(blocks)])
    with_tail = tail is not None and len(blocks) > len(keys)
    if _device_path(store, cache.kv.device):
        return _load_tensors(store, keys, namespace, cache, blocks, tail if with_tail else None,  # type: ignore[arg-type]
                             move_bytes)
    if isinstance(store, ScatterStore):
        return _load_in_place(store, keys, namespace, cache, blocks, tail if with_tail else None)
    wanted = keys + [tail[0]] if with_tail and tail else keys
    payloads = store.get(wanted)
    _, layers, _, _, heads, dim = cache.kv.shape
    bs = cache.block_size
    counts: list[int] = []  # tokens of each block landed in the cache, in order
    for i, payload in enumerate(payloads):
        if payload is None:
            break
        num_tokens = bs if i < len(keys) else tail[1]  # type: ignore[index]
        try:
            body, _ = verify_block(payload, namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim,
                                   dtype=cache.kv.dtype, num_tokens=num_tokens)
        except BlockError as exc:
            return _checked(store, wanted, cache, blocks, counts, exc)
        cache.write(blocks[i], body, num_tokens)
        counts.append(num_tokens)
    return _checked(store, wanted, cache, blocks, counts)


def _checked(store: KVStoreLike, keys: Sequence[BlockHash], cache: KVCache, blocks: Sequence[int], counts: list[int],
             error: BlockError | None = None, finite: Sequence[bool | None] = ()) -> Loaded:
    """The run of blocks that landed in ``blocks`` (``counts[i]`` tokens each), ended by ``error`` (a bad
    ``keys[len(counts)]``) if given, cut at its first block holding a NaN or an infinity (``finite[i]``: block
    i's values were checked as they were copied in); every bad block seen is removed from the store."""
    bad = [len(counts)] if error is not None else []
    nonfinite = nonfinite_blocks(cache, blocks, counts, finite)
    if nonfinite:
        error = BlockError("nonfinite", f"block {keys[nonfinite[0]].hex()[:16]} holds NaN or infinite values")
        counts = counts[: nonfinite[0]]
    rejected = tuple(keys[i] for i in [*nonfinite, *bad])
    if rejected:
        store.remove(rejected)
    return Loaded(sum(counts), error, rejected)


def nonfinite_blocks(cache: KVCache, blocks: Sequence[int], counts: Sequence[int],
                     finite: Sequence[bool | None] = ()) -> list[int]:
    """Which of the first len(counts) ``blocks`` hold a NaN or an infinity in their first ``counts[i]`` tokens;
    ``finite[i]``, where given and not None, is block i's answer already (checked as it was copied in).

    One sum per block (accumulated in float32, float64 for a float64 cache) and one check of them all:
    NaN and infinities carry through a sum, so a block whose sum is finite is. A non-finite sum is
    confirmed element by element (huge finite values could overflow the sum). Full blocks in consecutive
    slots (a fetched prefix, mostly) are summed in one call per run: 128 tiny-llama blocks (32 MiB) in
    0.8-1.2 ms on 2 cores, against 2.4-3.9 ms a block at a time, 17-27 us a block (a Zen 3)."""
    known = {i: ok for i, ok in enumerate(finite[: len(counts)]) if ok is not None}
    todo = [i for i in range(len(counts)) if i not in known]
    found = {i for i, ok in known.items() if not ok}
    acc = torch.float64 if cache.kv.dtype == torch.float64 else torch.float32
    sums: list[torch.Tensor] = []
    k = 0
    while k < len(todo):
        i, m = todo[k], k + 1
        if counts[i] == cache.block_size:
            while (m < len(todo) and todo[m] == todo[m - 1] + 1 and counts[todo[m]] == cache.block_size
                   and blocks[todo[m]] == blocks[todo[m - 1]] + 1):
                m += 1
        run = cache.kv[blocks[i] : blocks[i] + m - k, :, :, : counts[i]]  # [run, layers, 2, n, kv_heads, dim]
        sums.append(run.reshape(m - k, -1).sum(dim=1, dtype=acc))
        k = m
    if sums:
        finite_sums = torch.isfinite(torch.cat(sums)).tolist()  # [len(todo)]
        found.update(i for i, ok in zip(todo, finite_sums, strict=True)
                     if not ok and not torch.isfinite(cache.kv[blocks[i], :, :, : counts[i]].to(acc)).all())
    return sorted(found)


class _CheckedSlot:
    """A cache slot as the destination of a store read (kvstore.Sink) that checks the values for NaN and
    infinities as it copies them in: the check rides on the copy, where a pass of its own over a fetched prefix
    read it all again (128 blocks, 32 MiB: 1.7-2.0 ms on the fetching thread's one core)."""

    __slots__ = ("_copy", "_view", "finite")

    def __init__(self, view: memoryview, copy: native.CopyFinite) -> None:
        self._view, self._copy = view, copy
        self.finite: bool | None = None  # not filled yet

    def __len__(self) -> int:
        return len(self._view)

    def fill(self, src: memoryview) -> memoryview:
        dest = self._view[: len(src)]
        self.finite = self._copy(dest, src)
        return dest


def _load_in_place(
    store: ScatterStore, keys: list[BlockHash], namespace: Namespace, cache: KVCache, blocks: Sequence[int],
    tail: tuple[BlockHash, int] | None,
) -> Loaded:
    # Full blocks: header into a scratch buffer, tensor straight into the cache slot; a slot that
    # receives a bad block is not counted, and the engine computes over it. The tail (fewer tokens
    # than a slot holds, so another layout) goes through a scratch buffer.
    _, layers, _, _, heads, dim = cache.kv.shape
    headers = [memoryview(bytearray(HEADER_BYTES)) for _ in keys]
    copy = native.copy_finite(cache.kv.dtype)
    slots = [cache.slot_bytes(b) if copy is None else _CheckedSlot(cache.slot_bytes(b), copy)
             for b in blocks[: len(keys)]]
    buffers: list[Sequence[Part]] = [(h, slot) for h, slot in zip(headers, slots, strict=True)]
    scratch = memoryview(bytearray(HEADER_BYTES + cache.block_bytes if tail else 0))
    if tail is not None:
        buffers.append((scratch,))
    wanted = keys + [tail[0]] if tail is not None else keys
    sizes = store.get_into(wanted, buffers)
    finite = [slot.finite if isinstance(slot, _CheckedSlot) else None for slot in slots]
    bs = cache.block_size
    counts: list[int] = []  # tokens of each block landed in the cache, in order
    for i, size in enumerate(sizes):
        if size is None:
            break
        try:
            if i < len(keys):
                check_header(headers[i], size - HEADER_BYTES, namespace, num_layers=layers, num_kv_heads=heads,
                             head_dim=dim, dtype=cache.kv.dtype, num_tokens=bs)
                counts.append(bs)
                continue
            assert tail is not None
            body, n = verify_block(scratch[:size], namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim,
                                   dtype=cache.kv.dtype, num_tokens=tail[1], checked=True)
        except BlockError as exc:
            return _checked(store, wanted, cache, blocks, counts, exc, finite)
        cache.write(blocks[i], body, n)
        counts.append(n)
    return _checked(store, wanted, cache, blocks, counts, finite=finite)


def _load_tensors(
    store: TensorStore, keys: list[BlockHash], namespace: Namespace, cache: KVCache, blocks: Sequence[int],
    tail: tuple[BlockHash, int] | None, move_bytes: int,
) -> Loaded:
    # A bounded number of bytes at a time (the scratch on the device: the copies out of the store, and
    # the bodies stacked for the cache), up to the first miss or bad block. A device copy that fails (out
    # of memory) ends the run there: the engine computes the rest.
    wanted = keys + [tail[0]] if tail is not None else keys
    per_call = max(1, move_bytes // cache.block_bytes)
    counts: list[int] = []  # tokens of each block landed in the cache, in order
    error: BlockError | None = None
    try:
        for start in range(0, len(wanted), per_call):
            landed, error = _load_run(store, wanted[start : start + per_call], start, len(keys), namespace, cache,
                                      blocks, tail)
            counts += landed
            if error is not None or len(landed) < len(wanted[start : start + per_call]):
                break
    except RuntimeError:
        log.warning("moving KV blocks from the store into the cache failed: computing them instead", exc_info=True)
    return _checked(store, wanted, cache, blocks, counts, error)


def _load_run(
    store: TensorStore, wanted: list[BlockHash], first: int, num_full: int, namespace: Namespace, cache: KVCache,
    blocks: Sequence[int], tail: tuple[BlockHash, int] | None,
) -> tuple[list[int], BlockError | None]:
    """Blocks ``wanted`` (indexes ``first``... of the request: full blocks below ``num_full``, then the tail)
    into their cache blocks: the tokens of each that landed, and the error that stopped the run, if any.
    Every header goes to the host in one copy; full blocks' bodies into their cache slots in one
    index_copy (after one host-to-device copy for blocks that came as bytes); the tail by itself."""
    _, layers, _, _, heads, dim = cache.kv.shape
    found: list[torch.Tensor] = []  # the leading run of hits
    for t in store.get_tensors(wanted):
        if t is None:
            break
        found.append(t)
    error = None
    if any(t.numel() < HEADER_BYTES for t in found):
        short = next(i for i, t in enumerate(found) if t.numel() < HEADER_BYTES)
        error = BlockError("format", f"block {wanted[short].hex()[:16]} is shorter than a {HEADER_BYTES}-byte header")
        found = found[:short]
    headers = _stack([t[:HEADER_BYTES] for t in found], torch.device("cpu")).numpy()
    counts: list[int] = []
    for i, (header, t) in enumerate(zip(headers, found, strict=True)):
        num_tokens = cache.block_size if first + i < num_full else tail[1]  # type: ignore[index]
        try:
            check_header(header, t.numel() - HEADER_BYTES, namespace, num_layers=layers, num_kv_heads=heads,
                         head_dim=dim, dtype=cache.kv.dtype, num_tokens=num_tokens)
        except BlockError as exc:
            error = exc
            break
        counts.append(num_tokens)
    full = min(len(counts), num_full - first)
    if full:
        slots = cache.kv.view(cache.num_blocks, -1).view(torch.uint8).view(torch.int64)  # 8-byte words move faster
        index = torch.tensor(list(blocks[first : first + full]), dtype=torch.long).to(cache.kv.device, non_blocking=True)
        bodies = _stack([t[HEADER_BYTES:] for t in found[:full]], cache.kv.device)
        slots.index_copy_(0, index, bodies.view(torch.int64))
    if len(counts) > full:  # the tail
        cache.write(blocks[first + len(counts) - 1], found[len(counts) - 1][HEADER_BYTES:].to(cache.kv.device),
                   counts[-1])
    return counts, error


def _stack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[len(tensors), n] on ``device`` from equal-size flat tensors: one copy across devices at most."""
    if not tensors:
        return torch.empty((0, HEADER_BYTES), dtype=torch.uint8, device=device)
    if all(t.device == tensors[0].device for t in tensors):
        return torch.stack(list(tensors)).to(device)
    return torch.stack([t.to(device) for t in tensors])


def save_blocks(
    store: KVStoreLike, keys: Sequence[BlockHash], namespace: Namespace, kv: Sequence[torch.Tensor], num_tokens: int,
    tail_key: BlockHash | None = None, ephemeral: bool = False, *, move_bytes: int = MOVE_BYTES,
) -> int:
    """Put the full blocks of ``kv`` (each [layers, 2, block_size, kv_heads, head_dim]; ``num_tokens``
    tokens) under ``keys``, and a partial last block under ``tail_key`` if given (always ephemeral);
    returns how many blocks the store took. Each block goes as its header and a view of its tensor,
    so a same-host store copies it once, straight out of a cache slot. Blocks moved as tensors go
    ``move_bytes`` at a time."""
    bs = namespace.block_size
    num_full = num_tokens // bs
    if _device_path(store, kv[0].device if len(kv) else torch.device("cpu")):
        return _save_tensors(store, keys, namespace, kv, num_tokens, tail_key, ephemeral,  # type: ignore[arg-type]
                             move_bytes)
    stored = store.put([(key, encode_parts(kv[i], namespace)) for i, key in enumerate(keys[:num_full])],
                       ephemeral=ephemeral)
    if tail_key is not None and num_tokens % bs:
        stored += store.put([(tail_key, encode_parts(kv[num_full][:, :, : num_tokens % bs], namespace))],
                            ephemeral=True)
    return stored


def _save_tensors(
    store: TensorStore, keys: Sequence[BlockHash], namespace: Namespace, kv: Sequence[torch.Tensor], num_tokens: int,
    tail_key: BlockHash | None, ephemeral: bool, move_bytes: int,
) -> int:
    # Headers without a payload checksum (the store's covers each block), bodies as the cache's tensors: into
    # a device arena they never leave the device; anywhere else the store's client copies them to the host.
    bs = namespace.block_size
    num_full = num_tokens // bs
    per_call = max(1, move_bytes // kv[0].nbytes) if num_full else 1
    stored = 0
    for start in range(0, num_full, per_call):
        stored += store.put_tensors([(keys[i], (encode_header(kv[i], namespace), kv[i]))
                                     for i in range(start, min(start + per_call, num_full))], ephemeral=ephemeral)
    if tail_key is not None and num_tokens % bs:
        part = kv[num_full][:, :, : num_tokens % bs].contiguous()
        stored += store.put_tensors([(tail_key, (encode_header(part, namespace), part))], ephemeral=True)
    return stored
