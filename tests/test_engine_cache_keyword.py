"""The cache object reaches the model under the keyword the installed transformers fills.

transformers 5.17 takes ``past_key_values=`` and silently ignores ``cache=``; 5.24 takes ``cache=``.
A forward that drops the cache still runs (the paged attention then reads empty pool slots), so these
tests check that the KV got filled and reused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import transformers
from transformers import DynamicCache

from kvserve.engine.model import CACHE_KEYWORDS, Model, UnsupportedModelError, probe_cache
from tests.engine_fixtures import (
    ARCHS,
    DictStore,
    PrefixSource,
    assert_matches_oracle,
    make_engine,
    make_seq,
    random_tokens,
    run,
    tiny_model,
)

BLOCK = 8
PROMPT = random_tokens(21, seed=5)  # 2 full blocks of 8 and a tail of 5
NEW = 6


class KeywordFilter:
    """``hf_model`` seen through a forward that passes the cache on only when given as ``accepted``,
    and silently drops it under any other keyword, as transformers 5.17 does with ``cache=``."""

    def __init__(self, model: Model, accepted: str | None) -> None:
        self._inner = model.hf_model
        self._inner_keyword = model.cache_keyword
        self._accepted = accepted
        self.config = model.hf_model.config

    def forward(self, **kwargs: Any) -> Any:
        caches = {k: kwargs.pop(k) for k in CACHE_KEYWORDS if k in kwargs}
        if self._accepted in caches:
            kwargs[self._inner_keyword] = caches[self._accepted]
        return self._inner(**kwargs)

    __call__ = forward

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _assert_kv_filled_and_reused(model: Model) -> None:
    """An engine on ``model`` fills the pool with KV for every token of PROMPT, and a second sequence that
    loads the first one's blocks continues exactly as the first did and as the oracle does."""
    engine = make_engine(model, BLOCK, 16)
    source = PrefixSource(DictStore(), engine.namespace())
    cold = make_seq(model, PROMPT, NEW, source=source)
    (cold_out,) = run(engine, [cold])
    kv = source.saves[-1].kv  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    num_tokens = len(PROMPT) + NEW - 1
    per_token = kv.permute(0, 3, 1, 2, 4, 5).flatten(0, 1).flatten(1)[:num_tokens]  # [tokens, layers * 2 * ...]
    assert bool((per_token.abs().amax(dim=1) > 0).all()), "some token has all-zero KV"

    warm = make_seq(model, PROMPT, NEW, source=source)
    (warm_out,) = run(engine, [warm])
    assert warm.stats.num_loaded_tokens == len(PROMPT) // BLOCK * BLOCK
    assert warm_out.tokens == cold_out.tokens
    assert_matches_oracle(model, cold, cold_out)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_fills_and_reuses_the_kv_of_every_token(arch: str) -> None:
    _assert_kv_filled_and_reused(tiny_model(arch))


def test_a_forward_that_drops_the_cache_fails_the_check() -> None:
    model = tiny_model("llama")
    dropping = replace(model, hf_model=KeywordFilter(model, accepted=None))
    with pytest.raises(AssertionError):  # no error from the engine itself: empty KV, wrong tokens
        _assert_kv_filled_and_reused(dropping)


def test_probe_refuses_a_forward_that_drops_the_cache() -> None:
    model = tiny_model("llama")
    with pytest.raises(UnsupportedModelError, match=f"transformers {transformers.__version__}.*left the cache empty"):
        probe_cache(KeywordFilter(model, accepted=None), model.device)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("arch", ARCHS)
def test_detection_picks_the_preferred_keyword_the_installed_version_fills(arch: str) -> None:
    model = tiny_model(arch)
    fills = []
    for keyword in CACHE_KEYWORDS:
        cache = DynamicCache(config=model.hf_model.config)
        with torch.inference_mode():
            model.hf_model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{keyword: cache})
        if cache.get_seq_length() == 3:
            fills.append(keyword)
    assert fills, f"transformers {transformers.__version__} fills the cache under none of {CACHE_KEYWORDS}"
    assert model.cache_keyword == fills[0]


@pytest.mark.parametrize("accepted", CACHE_KEYWORDS)
def test_engine_passes_the_cache_under_the_detected_keyword(accepted: str) -> None:
    model = tiny_model("llama")
    probe = probe_cache(KeywordFilter(model, accepted), model.device)
    assert probe.keyword == accepted
    assert (probe.num_layers, probe.num_kv_heads, probe.head_dim) == (model.num_layers, model.num_kv_heads,
                                                                       model.head_dim)
    _assert_kv_filled_and_reused(replace(model, hf_model=KeywordFilter(model, accepted), cache_keyword=probe.keyword))
