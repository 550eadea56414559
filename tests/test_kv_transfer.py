"""Moving KV between a small real cache and a block store in a dict: exact blocks, exact bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch

from kvserve.engine import native
from kvserve.engine.hashing import Namespace
from kvserve.engine.kv_cache import KVCache
from kvserve.handoff.codec import decode_block, encode_block
from kvserve.handoff.transfer import (
    EncodedBlock,
    Loaded,
    encoded_bytes,
    load_blocks,
    nonfinite_blocks,
    save_blocks,
)
from kvstore import Part
from kvstore.client import KVStoreClient, scatter
from protos.block_hash import BlockHash
from tests.kvstore_fixtures import running_server

NS = Namespace("cd" * 32, "float32", block_size=4)
LAYERS, BS, HEADS, DIM = 2, 4, 2, 4


class DictStore:
    """A KVStoreLike in a dict that records what it was asked."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, bytes] = {}
        self.gets: list[list[BlockHash]] = []
        self.puts: list[tuple[list[BlockHash], bool]] = []  # (keys, ephemeral)
        self.removes: list[list[BlockHash]] = []

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        self.gets.append(list(hashes))
        return [self.blocks.get(h) for h in hashes]

    def put(self, blocks: Iterable[tuple[BlockHash, EncodedBlock]], ephemeral: bool = False) -> int:
        items = [(key, encoded_bytes(payload)) for key, payload in blocks]
        self.puts.append(([key for key, _ in items], ephemeral))
        self.blocks.update(items)
        return len(items)

    def remove(self, hashes: Sequence[BlockHash]) -> int:
        self.removes.append(list(hashes))
        return sum(self.blocks.pop(h, None) is not None for h in hashes)


def _key(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


KEYS = [_key(f"k{i}") for i in range(3)]
TAIL = _key("tail")


def _cache() -> KVCache:
    cache = KVCache(8, num_layers=LAYERS, block_size=BS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    cache.kv[4:].fill_(-1)  # blocks 4..7 receive; -1 marks a slot nothing was written to
    return cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _untouched(cache: KVCache, *blocks: int) -> bool:
    return bool((cache.kv[list(blocks)] == -1).all())


def _saved(num_tokens: int = 12, tail_key: BlockHash | None = None) -> tuple[DictStore, KVCache, torch.Tensor]:
    """Blocks 0..2 of a cache saved under KEYS (and the tail of ``num_tokens`` under ``tail_key``)."""
    store, cache = DictStore(), _cache()
    kv = cache.kv[[0, 1, 2]]  # a copy: [blocks, layers, 2, block_size, kv_heads, head_dim]
    save_blocks(store, KEYS, NS, kv, num_tokens, tail_key=tail_key)
    store.puts.clear()
    return store, cache, kv


def test_saved_blocks_load_back_bit_exactly_into_other_blocks() -> None:
    store, cache = DictStore(), _cache()
    cache.kv[1, 0, 0, 0, 0, 0] = torch.finfo(torch.float32).tiny / 2  # a subnormal: its bits must survive
    cache.kv[1, 0, 0, 0, 0, 1] = -0.0
    kv = cache.kv[[0, 1, 2]]
    assert save_blocks(store, KEYS, NS, kv, 12) == 3
    assert store.puts == [(KEYS, False)]

    assert load_blocks(store, KEYS, NS, cache, [6, 4, 5]) == Loaded(12)
    assert store.gets == [KEYS]
    assert torch.equal(_bits(cache.kv[[6, 4, 5]]), _bits(kv))
    assert _untouched(cache, 7)
    assert torch.equal(_bits(cache.kv[[0, 1, 2]]), _bits(kv))


def test_ephemeral_saves_are_put_as_ephemeral() -> None:
    store, cache = DictStore(), _cache()
    assert save_blocks(store, KEYS[:2], NS, cache.kv[[0, 1]], 8, ephemeral=True) == 2
    assert store.puts == [(KEYS[:2], True)]


def test_a_miss_stops_the_run() -> None:
    store, cache, kv = _saved()
    del store.blocks[KEYS[1]]
    assert load_blocks(store, KEYS, NS, cache, [4, 5, 6]) == Loaded(4)
    assert torch.equal(_bits(cache.kv[4]), _bits(kv[0]))
    assert _untouched(cache, 5, 6, 7)  # block 2 is in the store, but a prefix must be contiguous


def test_a_corrupt_block_stops_the_run_and_is_reported() -> None:
    store, cache, kv = _saved()
    bad = bytearray(store.blocks[KEYS[1]])
    bad[-1] ^= 0x01
    store.blocks[KEYS[1]] = bytes(bad)
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 4 and loaded.error is not None and loaded.error.kind == "checksum"
    assert torch.equal(_bits(cache.kv[4]), _bits(kv[0]))
    assert _untouched(cache, 5, 6, 7)
    assert loaded.rejected == (KEYS[1],) and store.removes == [[KEYS[1]]]  # the recomputed block can be put


@pytest.mark.parametrize("scatter_store", [False, True], ids=["bytes", "in-place"])
def test_blocks_with_nan_or_infinite_values_end_the_run_and_are_removed(scatter_store: bool) -> None:
    """Well-formed blocks (right header, right checksums) whose values are not: a poisoned store."""
    plain, cache = DictStore(), _cache()
    kv = cache.kv[[0, 1, 2]].clone()
    kv[1, 1, 0, 2, 1, 3] = float("nan")
    kv[2, 0, 1, 0, 0, 0] = float("-inf")
    save_blocks(plain, KEYS, NS, kv, 12)
    store = ScatterDictStore() if scatter_store else plain
    store.blocks = plain.blocks
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 4 and loaded.error is not None and loaded.error.kind == "nonfinite"
    assert loaded.rejected == (KEYS[1], KEYS[2]) and store.removes == [[KEYS[1], KEYS[2]]]
    assert set(store.blocks) == {KEYS[0]}
    assert torch.equal(_bits(cache.kv[4]), _bits(kv[0]))


def test_the_check_for_nonfinite_values_names_each_bad_block_in_runs_and_apart() -> None:
    """Full blocks in consecutive slots are summed in one call: each bad one is still named, a partial block
    is checked over its tokens only, and huge finite values whose sum overflows are not taken as bad."""
    cache = _cache()
    blocks, counts = [0, 1, 2, 5, 6, 3], [BS, BS, BS, BS, BS, 2]
    cache.kv[1, 0, 1, 3, 0, 0] = float("nan")
    cache.kv[5, 1, 0, 0, 1, 2] = float("inf")
    cache.kv[2, 0, 0].fill_(3e38)  # finite, but their float32 sum is not
    cache.kv[3, 0, 0, 3] = float("nan")  # past the partial block's 2 tokens
    assert nonfinite_blocks(cache, blocks, counts) == [1, 3]
    cache.kv[3, 1, 1, 1] = float("-inf")
    assert nonfinite_blocks(cache, blocks, counts) == [1, 3, 5]


def test_a_tail_with_infinite_values_is_removed_and_the_full_blocks_kept() -> None:
    plain, cache = DictStore(), _cache()
    kv = cache.kv[[0, 1, 2]].clone()
    kv[2, 1, 1, 1, 0, 0] = float("inf")  # token 1 of the tail's 2
    save_blocks(plain, KEYS[:2], NS, kv, 10, tail_key=TAIL)
    saved = dict(plain.blocks)
    for store in (plain, ScatterDictStore()):
        store.blocks = dict(saved)
        loaded = load_blocks(store, KEYS[:2], NS, cache, [4, 5, 6], (TAIL, 2))
        assert loaded.num_tokens == 8 and loaded.error is not None and loaded.error.kind == "nonfinite"
        assert loaded.rejected == (TAIL,) and TAIL not in store.blocks


def test_finite_blocks_are_never_removed() -> None:
    store, cache, kv = _saved(10, TAIL)
    cache.kv[[0, 1, 2]] = torch.finfo(torch.float32).max / 4  # large, but finite: a sum may not overflow to a false alarm
    store.blocks.clear()
    save_blocks(store, KEYS[:2], NS, cache.kv[[0, 1, 2]], 10, tail_key=TAIL)
    assert load_blocks(store, KEYS[:2], NS, cache, [4, 5, 6], (TAIL, 2)) == Loaded(10)
    assert store.removes == []


def test_a_block_of_another_shape_or_namespace_is_reported() -> None:
    store, cache, _ = _saved()
    store.blocks[KEYS[0]] = encode_block(torch.zeros(LAYERS, 2, BS, HEADS, DIM * 2), NS)
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 0 and loaded.error is not None and loaded.error.kind == "shape"
    assert loaded.rejected == (KEYS[0],) and store.removes == [[KEYS[0]]] and KEYS[0] not in store.blocks
    store, cache, _ = _saved()
    other = Namespace("cd" * 32, "float32", block_size=4, cache_salt="other")
    loaded = load_blocks(store, KEYS, other, cache, [4, 5, 6])
    assert loaded.num_tokens == 0 and loaded.error is not None and loaded.error.kind == "namespace"
    assert loaded.rejected == (KEYS[0],) and store.removes == [[KEYS[0]]]
    assert _untouched(cache, 4, 5, 6, 7)


def test_save_puts_the_tail_under_its_key_as_ephemeral() -> None:
    store, cache = DictStore(), _cache()
    kv = cache.kv[[0, 1, 2]]
    assert save_blocks(store, KEYS, NS, kv, 10, tail_key=TAIL) == 3
    assert store.puts == [(KEYS[:2], False), ([TAIL], True)]
    tail = decode_block(store.blocks[TAIL], NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                        dtype=torch.float32, num_tokens=2)
    assert torch.equal(_bits(tail), _bits(kv[2, :, :, :2]))  # [layers, 2, 2, kv_heads, head_dim]

    store = DictStore()
    assert save_blocks(store, KEYS, NS, kv, 10) == 2  # no tail key: the partial block stays here
    assert store.puts == [(KEYS[:2], False)]


def test_the_tail_loads_after_every_full_block_into_the_block_after_them() -> None:
    store, cache, kv = _saved(10, TAIL)
    assert load_blocks(store, KEYS[:2], NS, cache, [6, 4, 5], (TAIL, 2)) == Loaded(10)
    assert store.gets == [[*KEYS[:2], TAIL]]
    assert torch.equal(_bits(cache.kv[[6, 4]]), _bits(kv[:2]))
    assert torch.equal(_bits(cache.kv[5, :, :, :2]), _bits(kv[2, :, :, :2]))
    assert _untouched(cache, 7) and bool((cache.kv[5, :, :, 2:] == -1).all())  # only the tail's two slots


def test_the_tail_is_not_loaded_after_a_miss_or_without_a_block_for_it() -> None:
    store, cache, kv = _saved(10, TAIL)
    del store.blocks[KEYS[1]]
    assert load_blocks(store, KEYS[:2], NS, cache, [4, 5, 6], (TAIL, 2)) == Loaded(4)
    assert _untouched(cache, 5, 6, 7)

    store, cache, kv = _saved(10, TAIL)
    assert load_blocks(store, KEYS[:2], NS, cache, [4, 5], (TAIL, 2)) == Loaded(8)
    assert store.gets == [KEYS[:2]]  # no block left for the tail: not even asked for
    assert _untouched(cache, 6, 7)

    store, cache, kv = _saved(10, TAIL)
    assert load_blocks(store, KEYS, NS, cache, [4, 5], (TAIL, 2)) == Loaded(8)  # more keys than blocks
    assert store.gets == [KEYS[:2]]


def test_a_tail_of_the_wrong_length_is_reported_after_the_full_blocks() -> None:
    store, cache, kv = _saved(10, TAIL)
    loaded = load_blocks(store, KEYS[:2], NS, cache, [4, 5, 6], (TAIL, 3))
    assert loaded.num_tokens == 8 and loaded.error is not None and loaded.error.kind == "shape"
    assert torch.equal(_bits(cache.kv[[4, 5]]), _bits(kv[:2]))
    assert _untouched(cache, 6, 7)


class ScatterDictStore(DictStore):
    """A DictStore that copies into caller buffers, as the KV store's client does (which verifies
    each block against the store's checksum first: here every block is as put)."""

    def get_into(self, hashes: Sequence[BlockHash], buffers: Sequence[Sequence[Part]]) -> list[int | None]:
        return [len(p) if p is not None and scatter(p, parts) else None
                for p, parts in zip(self.get(hashes), buffers, strict=True)]


def test_a_scatter_store_lands_blocks_in_their_slots_and_the_tail_after_them() -> None:
    plain, cache, kv = _saved(10, TAIL)
    store = ScatterDictStore()
    store.blocks = plain.blocks
    assert load_blocks(store, KEYS[:2], NS, cache, [6, 4, 5], (TAIL, 2)) == Loaded(10)
    assert torch.equal(_bits(cache.kv[[6, 4]]), _bits(kv[:2]))
    assert torch.equal(_bits(cache.kv[5, :, :, :2]), _bits(kv[2, :, :, :2]))


def test_a_scatter_store_block_of_another_namespace_ends_the_run() -> None:
    plain, cache, kv = _saved()
    store = ScatterDictStore()
    store.blocks = plain.blocks
    store.blocks[KEYS[1]] = encode_block(kv[1], Namespace("cd" * 32, "float32", block_size=4, cache_salt="other"))
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 4 and loaded.error is not None and loaded.error.kind == "namespace"
    assert torch.equal(_bits(cache.kv[4]), _bits(kv[0]))  # slot 5 got bytes, but is not counted as loaded


def test_saved_blocks_are_views_of_the_pool_not_copies() -> None:
    store, cache = DictStore(), _cache()
    seen: list[EncodedBlock] = []
    store.put = lambda blocks, ephemeral=False: len([seen.append(p) for _, p in blocks])  # type: ignore[method-assign]
    save_blocks(store, KEYS[:1], NS, cache.kv[0:1], 4)  # a view of slot 0
    header, body = seen[0]  # type: ignore[misc]
    assert len(header) == 64 and bytes(body) == cache.kv[0].numpy().tobytes()
    cache.kv[0].fill_(7.0)
    assert bytes(body) == cache.kv[0].numpy().tobytes()  # the store is handed the slot itself


class TensorDictStore(DictStore):
    """A DictStore that moves blocks as tensors, as the KV store's client does with a device arena."""

    def tensor_device(self) -> torch.device:
        return torch.device("cpu")

    def get_tensors(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        return [None if p is None else torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in self.get(hashes)]

    def put_tensors(self, blocks: Iterable[tuple[BlockHash, Sequence[torch.Tensor | bytes]]],
                    ephemeral: bool = False) -> int:
        parts = [(key, b"".join(p if isinstance(p, bytes) else p.contiguous().view(torch.uint8).numpy().tobytes()
                                for p in payload)) for key, payload in blocks]
        return self.put(parts, ephemeral)


@pytest.mark.parametrize("blocks_a_call", [1, 2, 64])
def test_a_tensor_store_round_trips_full_blocks_and_the_tail_without_payload_checksums(blocks_a_call: int) -> None:
    move_bytes = blocks_a_call * LAYERS * 2 * BS * HEADS * DIM * 4
    store, cache = TensorDictStore(), _cache()
    kv = cache.kv[[0, 1, 2]]
    assert save_blocks(store, KEYS, NS, kv, 10, tail_key=TAIL, move_bytes=move_bytes) == 3
    assert [k for keys, _ in store.puts for k in keys] == [*KEYS[:2], TAIL] and store.puts[-1] == ([TAIL], True)
    assert all(block[44:52] == bytes(8) for block in store.blocks.values())  # the store's checksum covers them
    assert load_blocks(store, KEYS[:2], NS, cache, [6, 4, 5], (TAIL, 2), move_bytes=move_bytes) == Loaded(10)
    assert torch.equal(_bits(cache.kv[[6, 4]]), _bits(kv[:2]))
    assert torch.equal(_bits(cache.kv[5, :, :, :2]), _bits(kv[2, :, :, :2]))
    assert _untouched(cache, 7) and bool((cache.kv[5, :, :, 2:] == -1).all())
    plain = DictStore()  # and a block without a payload checksum still reads through the bytes path
    plain.blocks = store.blocks
    assert load_blocks(plain, KEYS[:2], NS, cache, [4, 5], None) == Loaded(8)


def test_a_tensor_store_run_ends_at_a_miss_a_bad_header_or_a_short_block() -> None:
    store, cache = TensorDictStore(), _cache()
    kv = cache.kv[[0, 1, 2]].clone()
    save_blocks(store, KEYS, NS, kv, 12)
    del store.blocks[KEYS[2]]
    assert load_blocks(store, KEYS, NS, cache, [4, 5, 6]) == Loaded(8)
    assert _untouched(cache, 6, 7)
    store.blocks[KEYS[1]] = encode_block(kv[1], Namespace("cd" * 32, "float32", block_size=4, cache_salt="other"))
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 4 and loaded.error is not None and loaded.error.kind == "namespace"
    assert loaded.rejected == (KEYS[1],) and KEYS[1] not in store.blocks
    store.blocks[KEYS[0]] = b"short"
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 0 and loaded.error is not None and loaded.error.kind == "format"
    assert loaded.rejected == (KEYS[0],)


def test_a_tensor_store_block_with_nan_is_removed() -> None:
    store, cache = TensorDictStore(), _cache()
    kv = cache.kv[[0, 1, 2]].clone()
    kv[1, 0, 1, 0, 0, 0] = float("nan")
    save_blocks(store, KEYS, NS, kv, 12)
    loaded = load_blocks(store, KEYS, NS, cache, [4, 5, 6])
    assert loaded.num_tokens == 4 and loaded.error is not None and loaded.error.kind == "nonfinite"
    assert loaded.rejected == (KEYS[1],)


def test_blocks_move_through_a_real_store_device_arena_bit_exactly(tmp_path: Path) -> None:
    """The KV store's client over a store whose device tier is a CPU arena: the device-to-device path,
    with the bytes of a corrupted slot a miss, never data."""
    with running_server(tmp_path, device="cpu", device_capacity=32 << 20) as server, \
            KVStoreClient(server.address) as client:
        assert client.tensor_device() == torch.device("cpu")
        cache = _cache()
        kv = cache.kv[[0, 1, 2]]
        assert save_blocks(client, KEYS, NS, kv, 10, tail_key=TAIL) == 3
        assert client.stats().tier("device").blocks == 3
        assert load_blocks(client, KEYS[:2], NS, cache, [6, 4, 5], (TAIL, 2)) == Loaded(10)
        assert torch.equal(_bits(cache.kv[[6, 4]]), _bits(kv[:2]))
        assert torch.equal(_bits(cache.kv[5, :, :, :2]), _bits(kv[2, :, :, :2]))
        device = server.store.shm_tier
        assert device is not None
        offset, size, _ = device.slot(KEYS[1])  # type: ignore[misc]
        device.segment.tensor[offset + size - 1] ^= 0xFF  # type: ignore[attr-defined]
        assert load_blocks(client, KEYS[:2], NS, cache, [4, 5, 6]) == Loaded(4)
        assert client.stats().checksum_failures == 1


def test_a_device_copy_that_fails_ends_the_run_where_it_failed() -> None:
    """Out of memory on the device while moving a prefix in: the blocks moved before count, the rest are
    computed; nothing is removed from the store."""
    one_block = LAYERS * 2 * BS * HEADS * DIM * 4  # a call
    store, cache = TensorDictStore(), _cache()
    kv = cache.kv[[0, 1, 2]].clone()
    save_blocks(store, KEYS, NS, kv, 12, move_bytes=one_block)
    calls = 0
    get_tensors = store.get_tensors

    def failing(hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("CUDA out of memory")
        return get_tensors(hashes)

    store.get_tensors = failing  # type: ignore[method-assign]
    assert load_blocks(store, KEYS, NS, cache, [4, 5, 6], move_bytes=one_block) == Loaded(4)
    assert torch.equal(_bits(cache.kv[4]), _bits(kv[0])) and store.removes == []


copy_finite = native.copy_finite(torch.float32)
needs_native = pytest.mark.skipif(copy_finite is None, reason="no C compiler here: fetched blocks are checked apart")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_checking_copy_moves_every_bit_and_finds_each_nan_and_infinity(dtype: torch.dtype) -> None:
    copy = native.copy_finite(dtype)
    assert copy is not None
    info = torch.finfo(dtype)
    values = torch.tensor([0.0, -0.0, 1.5, info.max, -info.max, info.tiny, info.tiny / 2, info.min], dtype=dtype)
    src = values.view(torch.uint8).numpy().tobytes() + b"\x7f"  # and a byte past the last whole value
    for bad in [None, float("nan"), float("inf"), float("-inf")]:
        data = bytearray(src)
        if bad is not None:
            data[2 * dtype.itemsize : 3 * dtype.itemsize] = torch.tensor([bad], dtype=dtype).view(torch.uint8).numpy().tobytes()
        dest = memoryview(bytearray(len(data) + 4))
        for source in (memoryview(bytes(data)), memoryview(data)):  # read-only (a gRPC payload) and writable (shm)
            dest[:] = bytes(len(dest))
            assert copy(dest, source) is (bad is None)
            assert bytes(dest[: len(data)]) == bytes(data) and bytes(dest[len(data) :]) == bytes(4)
    with pytest.raises(ValueError, match="do not fit"):
        copy(memoryview(bytearray(3)), memoryview(bytes(4)))
    assert native.copy_finite(torch.int64) is None


def test_the_check_for_nonfinite_values_takes_the_verdicts_of_the_copy_and_checks_the_rest() -> None:
    cache = _cache()
    blocks, counts = [0, 1, 2, 3], [BS, BS, BS, BS]
    cache.kv[2, 0, 0, 0, 0, 0] = float("nan")
    cache.kv[3, 1, 1, 1, 1, 1] = float("inf")
    assert nonfinite_blocks(cache, blocks, counts) == [2, 3]
    assert nonfinite_blocks(cache, blocks, counts, [False, True, None, None]) == [0, 2, 3]
    assert nonfinite_blocks(cache, blocks, counts, [True, True, True, None]) == [3]  # 2's verdict stands
    assert nonfinite_blocks(cache, blocks, counts[:2], [True, True, False, False]) == []  # past the run


def test_blocks_with_nan_through_a_real_stores_shared_memory_end_the_run_and_are_removed(tmp_path: Path) -> None:
    """The same-host path end to end: each block copied out of the store's host arena straight into its slot,
    its values checked on the way in (by the C copy where it builds)."""
    with running_server(tmp_path) as server, KVStoreClient(server.address) as client:
        cache = _cache()
        kv = cache.kv[[0, 1, 2]].clone()
        kv[1, 1, 0, 2, 1, 3] = float("nan")
        assert save_blocks(client, KEYS, NS, kv, 12) == 3
        loaded = load_blocks(client, KEYS, NS, cache, [4, 5, 6])
        assert loaded.num_tokens == 4 and loaded.error is not None and loaded.error.kind == "nonfinite"
        assert loaded.rejected == (KEYS[1],) and client.lookup(KEYS).num_hits == 1
        assert torch.equal(_bits(cache.kv[4]), _bits(kv[0]))
        kv[1, 1, 0, 2, 1, 3] = 0.5
        assert save_blocks(client, KEYS, NS, kv, 12) == 1  # the block computed in its place is taken
        assert load_blocks(client, KEYS, NS, cache, [4, 5, 6]) == Loaded(12)
        assert torch.equal(_bits(cache.kv[[4, 5, 6]]), _bits(kv))
