"""Engine helpers the services share: sizing the KV cache from a byte budget, and the number of tokens a
request may generate. (Moving KV between the KV cache and a store: tests/test_kv_transfer.py.)"""

from __future__ import annotations

import pytest

from kvserve.engine.engine import Engine, RequestTooLarge
from kvserve.engine.kv_cache import KVCache, kv_cache_blocks
from kvserve.engine.model import DEFAULT_MAX_NEW_TOKENS, ContextLengthError, max_new_tokens
from tests.engine_fixtures import tiny_model


def test_the_kv_cache_is_sized_by_bytes() -> None:
    model = tiny_model("llama")
    per_block = KVCache.bytes_per_block(num_layers=model.num_layers, block_size=16, num_kv_heads=model.num_kv_heads,
                                        head_dim=model.head_dim, dtype=model.dtype)
    assert per_block == model.num_layers * 2 * 16 * model.num_kv_heads * model.head_dim * 4
    assert kv_cache_blocks(model, 16, 10 * per_block + per_block - 1) == 10
    with pytest.raises(ValueError, match="holds no block"):
        kv_cache_blocks(model, 16, per_block - 1)
    engine = Engine(model, 16, kv_cache_memory=3 * per_block)
    assert engine.kv_cache.kv.shape == (3, model.num_layers, 2, 16, model.num_kv_heads, model.head_dim)
    assert (engine.pool.num_free, engine.pool.num_used, engine.pool.num_cached) == (3, 0, 0)
    assert RequestTooLarge.grpc_status == "RESOURCE_EXHAUSTED"


def test_max_new_tokens_fits_the_model_positions() -> None:
    model = tiny_model("llama")
    limit = model.max_positions
    assert limit == 4096
    assert max_new_tokens(model, 10, 0) == DEFAULT_MAX_NEW_TOKENS
    assert max_new_tokens(model, limit - 5, 0) == 5
    assert max_new_tokens(model, 10, limit - 10) == limit - 10
    with pytest.raises(ContextLengthError, match=f"ask for at most {limit - 10} tokens"):
        max_new_tokens(model, 10, limit - 9)
    with pytest.raises(ContextLengthError, match=f"shorter than {limit} tokens"):
        max_new_tokens(model, limit, 1)
    assert ContextLengthError.grpc_status == "OUT_OF_RANGE"
