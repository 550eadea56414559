"""The cache object reaches the model under the keyword the installed transformers fills.

transformers 5.17 takes ``past_key_values=`` and silently ignores ``cache=``; 5.24 takes ``cache=``.
A forward that drops the cache still runs, so these tests check that the KV got filled and reused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import transformers
from transformers import DynamicCache

from engine.engine import Engine, PrefillResult
from engine.model import CACHE_KEYWORDS, Model, UnsupportedModelError, probe_cache
from tests.engine_fixtures import ARCHS, random_tokens, tiny_model

BLOCK = 8
PROMPT = random_tokens(21, seed=5)  # 2 full blocks of 8 and a tail of 5
NEXT_TOKEN = 7


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


def _engine(model: Model) -> Engine:
    return Engine(model, block_size=BLOCK)


def _assert_kv_filled_and_reused(engine: Engine, full: PrefillResult) -> None:
    """``full`` (a cold prefill of PROMPT on any engine of the same model) holds KV for every token, and
    ``engine`` continues from cached blocks and from a sequence exactly as it would from scratch."""
    m = engine.model
    assert len(full.new_blocks) == 2 and full.tail is not None
    kv = torch.cat([*full.new_blocks, full.tail], dim=3)  # [L, 2, H, 21, D]
    assert kv.shape == (m.num_layers, 2, m.num_kv_heads, len(PROMPT), m.head_dim)
    assert bool((kv.abs().amax(dim=(0, 1, 2, 4)) > 0).all()), "some token has all-zero KV"

    warm = engine.prefill(PROMPT, full.new_blocks)
    torch.testing.assert_close(warm.logits, full.logits, atol=1e-4, rtol=0)
    assert warm.tail is not None
    torch.testing.assert_close(warm.tail, full.tail, atol=1e-4, rtol=0)

    reference = engine.prefill([*PROMPT, NEXT_TOKEN]).logits
    step = engine.decode_step([engine.resume(PROMPT, full.new_blocks, full.tail)], [NEXT_TOKEN])[0]
    torch.testing.assert_close(step, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_fills_and_reuses_the_kv_of_every_token(arch: str) -> None:
    engine = _engine(tiny_model(arch))
    _assert_kv_filled_and_reused(engine, engine.prefill(PROMPT))


def test_a_forward_that_drops_the_cache_fails_the_check() -> None:
    model = tiny_model("llama")
    full = _engine(model).prefill(PROMPT)
    dropping = _engine(replace(model, hf_model=KeywordFilter(model, accepted=None)))
    with pytest.raises(AssertionError):  # wrong logits, no error from the engine itself
        _assert_kv_filled_and_reused(dropping, full)


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
    filtered = replace(model, hf_model=KeywordFilter(model, accepted), cache_keyword=probe.keyword)
    engine = _engine(filtered)
    _assert_kv_filled_and_reused(engine, engine.prefill(PROMPT))
