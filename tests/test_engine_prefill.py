"""A prompt computed over KV from elsewhere (docs/DESIGN.md, "Engine", "KV block format"): the pool's slots
hold, token-major, exactly the keys and values Hugging Face computes; a prompt whose leading blocks are
loaded from the store, through the block codec, continues exactly as one computed from scratch; the last
prompt token is always computed; a block that is missing or fails verification is recomputed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from kvserve.engine.engine import Engine
from kvserve.engine.hashing import prefix_hashes
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.model import Model, layer_kv
from kvserve.engine.sequence import Sequence
from kvserve.handoff.codec import decode_block, encode_block
from kvserve.handoff.transfer import load_blocks, save_blocks
from protos.block_hash import BlockHash
from tests.engine_fixtures import (
    ARCHS,
    DictStore,
    PrefixSource,
    Save,
    assert_matches_oracle,
    make_engine,
    make_seq,
    oracle,
    random_tokens,
    run,
    stock_model,
    tiny_model,
)

BLOCK = 8
PROMPT = random_tokens(61, seed=1)  # 7 full blocks of 8 and a tail of 5
NEW = 8
TAIL_KEY = BlockHash(b"\x01" * 32)


@dataclass(frozen=True)
class Cold:
    """PROMPT computed from scratch: the KV its sequence saved on finishing, and its store."""

    model: Model
    save: Save
    store: DictStore
    first_token: int


def _engine(model: Model) -> Engine:
    return make_engine(model, BLOCK, 32)


@pytest.fixture(scope="module", params=ARCHS)
def cold(request: pytest.FixtureRequest) -> Cold:
    model = tiny_model(request.param)
    engine = _engine(model)
    source = PrefixSource(DictStore(), engine.namespace())
    seq = make_seq(model, PROMPT, 1, source=source)
    (outcome,) = run(engine, [seq])
    (save,) = source.saves
    return Cold(model, save, source.store, outcome.tokens[0])


def _store_with(cold: Cold, num_blocks: int) -> DictStore:
    """A store holding the cold run's first ``num_blocks`` blocks of PROMPT."""
    store = DictStore()
    keys = PrefixSource(store, _engine(cold.model).namespace()).keys(PROMPT)
    store.blocks = {key: cold.store.blocks[key] for key in keys[:num_blocks]}
    return store


def _tokens(kv: torch.Tensor) -> torch.Tensor:
    """[blocks, layers, 2, block_size, kv_heads, head_dim] -> [layers, 2, blocks * block_size, kv_heads, head_dim]."""
    b, layers, _, bs, heads, dim = kv.shape
    return kv.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, b * bs, heads, dim)


def test_the_pool_holds_hugging_face_keys_and_values_token_major(cold: Cold) -> None:
    m, save = cold.model, cold.save
    assert (save.first_block, save.num_tokens) == (0, 61)
    assert save.kv.shape == (8, m.num_layers, 2, BLOCK, m.num_kv_heads, m.head_dim) and save.kv.dtype == m.dtype
    assert len(cold.store.blocks) == 7  # full blocks only: a tail is request-scoped
    cache = DynamicCache(config=m.hf_model.config)
    with torch.inference_mode():  # Hugging Face's own model: an engine's runs through its packed layers
        stock_model(m.path, m.dtype, m.device)(input_ids=torch.tensor([PROMPT]), use_cache=True,
                                               **{m.cache_keyword: cache})
    kv = _tokens(save.kv)[:, :, :61]
    for layer, cache_layer in enumerate(cache.layers):
        keys, values = layer_kv(cache_layer)  # [1, kv_heads, tokens, head_dim]
        torch.testing.assert_close(kv[layer, 0], keys[0].transpose(0, 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(kv[layer, 1], values[0].transpose(0, 1), atol=1e-5, rtol=0)
    assert cold.first_token == oracle(m, PROMPT, 1)[0][0]


@pytest.mark.parametrize("num_stored_blocks", [1, 3, 7])
def test_a_prompt_over_stored_blocks_continues_as_from_scratch(cold: Cold, num_stored_blocks: int) -> None:
    model = cold.model
    engine = _engine(model)
    source = PrefixSource(_store_with(cold, num_stored_blocks), engine.namespace())
    seq = make_seq(model, PROMPT, NEW, source=source)
    (outcome,) = run(engine, [seq])
    loaded = BLOCK * num_stored_blocks
    assert (seq.stats.num_loaded_tokens, seq.stats.num_engine_computed_tokens) == (loaded, 61 - loaded)
    assert_matches_oracle(model, seq, outcome)
    # What it computed over the loaded blocks is what the cold run computed.
    warm = _tokens(source.saves[-1].kv)
    torch.testing.assert_close(warm[:, :, loaded:61], _tokens(cold.save.kv)[:, :, loaded:61], atol=1e-5, rtol=0)


def test_a_block_aligned_prompt_computes_its_last_block(cold: Cold) -> None:
    model = cold.model
    engine = _engine(model)
    seq = make_seq(model, PROMPT[:56], NEW, source=PrefixSource(_store_with(cold, 7), engine.namespace()))
    (outcome,) = run(engine, [seq])
    assert (seq.stats.num_loaded_tokens, seq.stats.num_engine_computed_tokens) == (48, 8)
    assert_matches_oracle(model, seq, outcome)


class Overreaching(PrefixSource):
    """Loads every full block, the last prompt token's too, and claims more tokens than the sequence has."""

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        loaded = load_blocks(self.store, self.keys(seq.token_ids)[first_block:], self.namespace, cache, blocks)
        return loaded.num_tokens + 100


def test_the_last_prompt_token_is_computed_whatever_the_source_says(cold: Cold) -> None:
    model = cold.model
    engine = _engine(model)
    seq = make_seq(model, PROMPT[:56], NEW, source=Overreaching(_store_with(cold, 7), engine.namespace()))
    (outcome,) = run(engine, [seq])
    assert (seq.stats.num_loaded_tokens, seq.stats.num_engine_computed_tokens) == (55, 1)
    assert_matches_oracle(model, seq, outcome)


class HandOff(PrefixSource):
    """Decode's side of the hand-off: the prompt's full blocks, then its partial tail."""

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        keys = self.keys(PROMPT)[first_block:]
        return load_blocks(self.store, keys, self.namespace, cache, blocks, tail=(TAIL_KEY, 5)).num_tokens


def test_a_handed_off_prompt_with_its_tail_computes_only_the_first_token(cold: Cold) -> None:
    model = cold.model
    engine = _engine(model)
    store = DictStore()
    keys = prefix_hashes(PROMPT, BLOCK, engine.namespace().root())
    assert save_blocks(store, keys, engine.namespace(), cold.save.kv, 61, tail_key=TAIL_KEY) == 8
    source = HandOff(store, engine.namespace())
    seq = make_seq(model, [*PROMPT, cold.first_token], NEW, source=source, num_saved_blocks=7)
    (outcome,) = run(engine, [seq])
    assert (seq.stats.num_loaded_tokens, seq.stats.num_engine_computed_tokens) == (61, 1)
    assert_matches_oracle(model, seq, outcome)
    assert source.saves[-1].first_block == 7  # blocks the store already holds are not saved again


class Failing(PrefixSource):
    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        raise ConnectionError("the store is down")


@pytest.mark.parametrize("fault", ["corrupt", "other namespace", "source fails"])
def test_a_bad_block_is_a_miss_and_what_follows_is_recomputed(cold: Cold, fault: str) -> None:
    model = cold.model
    engine = _engine(model)
    ns = engine.namespace()
    store = _store_with(cold, 7)
    keys = PrefixSource(store, ns).keys(PROMPT)
    if fault == "corrupt":
        payload = bytearray(store.blocks[keys[3]])
        payload[-1] ^= 0xFF
        store.blocks[keys[3]] = bytes(payload)
    elif fault == "other namespace":
        shape = {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim}
        other = engine.namespace("another tenant")
        store.blocks = {k: encode_block(decode_block(p, ns, **shape, dtype=model.dtype), other)
                        for k, p in store.blocks.items()}
    source = (Failing if fault == "source fails" else PrefixSource)(store, ns)
    seq = make_seq(model, PROMPT, NEW, source=source)
    (outcome,) = run(engine, [seq])
    loaded = 24 if fault == "corrupt" else 0
    assert (seq.stats.num_loaded_tokens, seq.stats.num_engine_computed_tokens) == (loaded, 61 - loaded)
    assert_matches_oracle(model, seq, outcome)
