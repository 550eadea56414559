"""The KV cache's tensor: a block's slot in the layout of a stored block, token-major."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.kv_cache import KVCache


def test_write_lands_full_and_tail_blocks_in_their_slots_token_major() -> None:
    layers, bs, heads, dim = 2, 4, 2, 3
    cache = KVCache(4, num_layers=layers, block_size=bs, num_kv_heads=heads, head_dim=dim, dtype=torch.float32)
    cache.kv.fill_(-1)
    full = torch.arange(layers * 2 * bs * heads * dim, dtype=torch.float32).view(layers, 2, bs, heads, dim)
    tail = 1000 + torch.arange(layers * 2 * 3 * heads * dim, dtype=torch.float32).view(layers, 2, 3, heads, dim)

    cache.write(1, memoryview(full.numpy().tobytes()), bs)
    cache.write(2, memoryview(tail.numpy().tobytes()), 3)

    assert torch.equal(cache.kv[1], full)
    assert torch.equal(cache.kv[2, :, :, :3], tail)
    assert bool((cache.kv[2, :, :, 3:] == -1).all())  # the slot past the tail is untouched
    assert bool((cache.kv[0] == -1).all()) and bool((cache.kv[3] == -1).all())
    # token-major: token t of layer l, keys, head h is full[l, 0, t, h]
    assert torch.equal(cache.layer(1, 0)[1, 2], full[1, 0, 2])
    assert torch.equal(cache.layer(0, 1)[2, 1], tail[0, 1, 1])
    assert cache.layer(1, 1)[1, 3, 1].tolist() == [float(x) for x in range(93, 96)]


def test_slot_bytes_are_the_slot_itself() -> None:
    cache = KVCache(2, num_layers=1, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    view = cache.slot_bytes(1)
    assert len(view) == KVCache.bytes_per_block(num_layers=1, block_size=2, num_kv_heads=1, head_dim=2,
                                                dtype=torch.float32) == 32
    view[:4] = torch.tensor([2.5]).numpy().tobytes()
    assert cache.kv[1].flatten()[0].item() == 2.5 and not cache.kv[0].any()
    with pytest.raises(ValueError, match="at least one block"):
        KVCache(0, num_layers=1, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
