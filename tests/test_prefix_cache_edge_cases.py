"""Edge cases of the prefix cache through the real prefill and decode servers (in process, over an
in-memory store), checked against Hugging Face `generate`: prompt lengths at and around block
boundaries, one-token prompts, a prompt that extends a cached one by a token, a continuation that
differs inside a block, block sizes 8 and 32, every arch; seeded sampling cold and warm; EOS;
stop strings over multi-byte characters; unicode chat; the store failing during decode's put;
prefill and decode configured with different block sizes or different models."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import pytest
import torch
from transformers import GenerationConfig

from client import Client
from client.client import FailedPreconditionError, Result
from kvserve.engine.hashing import prefix_hashes
from tests.stack_fixtures import (
    ARCHS,
    BLOCK_SIZE,
    FakeRpcError,
    FakeStore,
    LocalStack,
    _hf_model,
    assert_greedy_matches,
    engine,
    greedy,
    oracle,
    stack_fixture,
    tokens,
)

NEW_TOKENS = 8


stack = stack_fixture(LocalStack, params=[{"arch": arch, "block_size": bs} for arch in ARCHS for bs in (8, 32)],
                      ids=lambda p: f"{p['arch']}-bs{p['block_size']}")


def check(arch: str, ids: list[int], r: Result, n: int = NEW_TOKENS) -> None:
    want, logits = oracle(arch, ids, n)
    assert_greedy_matches(r.token_ids, want, logits)
    assert len(r.token_ids) == n


def test_prompt_lengths_around_block_boundaries(stack: LocalStack) -> None:
    """Cold then warm, for 1 token, bs - 1, bs, bs + 1, 2 bs and 3 bs + 1 tokens: the cached
    tokens are every full block but the one holding the last prompt token."""
    bs = stack.block_size
    base = tokens(3 * bs + 1, seed=bs)
    with Client(stack.addr, timeout_s=60) as c:
        for n in (1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 1):
            ids = base[:n]
            cold, warm = greedy(c, ids, NEW_TOKENS), greedy(c, ids, NEW_TOKENS)
            check(stack.arch, ids, cold)
            assert warm.token_ids == cold.token_ids, f"{n} tokens: warm differs from cold"
            assert warm.usage.cached_tokens == (n - 1) // bs * bs, f"{n} tokens"


def test_a_prompt_one_token_longer_than_a_cached_one(stack: LocalStack) -> None:
    bs = stack.block_size
    whole = tokens(2 * bs, seed=10 + bs)  # exactly two blocks, both stored by the first request
    with Client(stack.addr, timeout_s=60) as c:
        check(stack.arch, whole, greedy(c, whole, NEW_TOKENS))
        longer = [*whole, 7]
        r = greedy(c, longer, NEW_TOKENS)
        assert r.usage.cached_tokens == 2 * bs  # only the new token is computed
        check(stack.arch, longer, r)


def test_a_continuation_that_differs_inside_a_block(stack: LocalStack) -> None:
    bs = stack.block_size
    a = tokens(3 * bs + 2, seed=20 + bs)
    b = [*a[: 2 * bs + 3], *(t ^ 1 for t in a[2 * bs + 3 :])]  # same first 2 blocks + 3 tokens
    with Client(stack.addr, timeout_s=60) as c:
        greedy(c, a, NEW_TOKENS)
        r = greedy(c, b, NEW_TOKENS)
        assert r.usage.cached_tokens == 2 * bs
        check(stack.arch, b, r)


# --- one stack per arch at the default block size ----------------------------------------------


arch_stack = stack_fixture(LocalStack, params=[{"arch": arch} for arch in ARCHS], ids=ARCHS)


def test_seeded_sampling_is_the_same_cold_and_warm(arch_stack: LocalStack) -> None:
    """Exact, not near-tie tolerant: the same path on the same machine computes the same logits,
    and a flip would need a uniform draw within ~1e-7 of a boundary."""
    ids = tokens(50, seed=30)
    kw = dict(max_tokens=20, temperature=0.8, top_k=40, top_p=0.9, seed=123, ignore_eos=True)
    with Client(arch_stack.addr, timeout_s=60) as c:
        cold = c.generate(token_ids=ids, **kw)  # type: ignore[arg-type]
        warm = c.generate(token_ids=ids, **kw)  # type: ignore[arg-type]
        off = c.generate(token_ids=ids, prefix_cache=False, **kw)  # type: ignore[arg-type]
        other_seed = c.generate(token_ids=ids, **{**kw, "seed": 124})  # type: ignore[arg-type]
    assert warm.usage.cached_tokens > 0
    assert cold.token_ids == warm.token_ids == off.token_ids
    assert other_seed.token_ids != cold.token_ids


def hf_generate_with_eos(arch: str, ids: list[int], n: int) -> list[int]:
    eos = sorted(engine(arch).model.eos_token_ids)
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = _hf_model(arch).generate(  # type: ignore[operator]
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    return list(out[0, len(ids):].tolist())


# (arch, prompt seed) whose 12-token prompt makes the tiny model emit EOS within 60 tokens.
EOS_PROMPTS = {"llama": 5003, "qwen2": 5001, "gpt2": 5059}


def test_eos_ends_the_generation_like_hf(arch_stack: LocalStack) -> None:
    arch = arch_stack.arch
    ids = tokens(12, seed=EOS_PROMPTS[arch])
    want = hf_generate_with_eos(arch, ids, 60)
    eos = engine(arch).model.eos_token_ids
    assert want[-1] in eos, "the prompt no longer leads to EOS: pick another seed"
    with Client(arch_stack.addr, timeout_s=60) as c:
        for _ in range(2):  # cold, warm
            r = c.generate(token_ids=ids, max_tokens=60)
            assert list(r.token_ids) == want and r.finish_reason == "eos"
        # EOS as the very first token, which prefill samples: decode never runs a step.
        first_eos = [*ids, *want[:-1]]
        r = c.generate(token_ids=first_eos, max_tokens=60)
        assert list(r.token_ids) == [want[-1]] and r.finish_reason == "eos" and r.text == ""
        assert r.usage.cached_tokens == (len(first_eos) - 1) // 16 * 16  # the first reply's blocks


def test_stop_string_over_a_multibyte_character(arch_stack: LocalStack) -> None:
    """The stop string is the character before a multi-byte one plus that character: it spans at
    least three byte tokens. The text stops right before it, streamed and final alike."""
    with Client(arch_stack.addr, timeout_s=60) as c:
        for seed in range(2000, 2040):
            ids = tokens(20, seed=seed)
            text = greedy(c, ids, 40).text
            wide = [i for i, ch in enumerate(text) if i > 0 and ord(ch) > 127 and ch != "\ufffd"]
            if wide:
                break
        else:
            pytest.fail("no multi-byte character in 40 generations")
        stop = text[wide[0] - 1 : wide[0] + 1]
        items = list(c.stream(token_ids=ids, max_tokens=40, ignore_eos=True, stop=[stop]))
    result = items[-1]
    assert isinstance(result, Result) and result.finish_reason == "stop"
    assert result.text == text[: text.find(stop)]
    assert "".join(chunk.text for chunk in items[:-1]) == result.text  # type: ignore[union-attr]


def test_unicode_chat_matches_hf(arch_stack: LocalStack) -> None:
    arch = arch_stack.arch
    messages = [
        {"role": "system", "content": "Tu es un assistant. 日本語で答えて 🙂"},
        {"role": "user", "content": "Ça va ? ünïcödé — 你好 👋🏽"},
    ]
    tokenizer = engine(arch).model.tokenizer
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "👋🏽" in rendered
    with Client(arch_stack.addr, timeout_s=60) as c:
        cold = c.chat(messages, max_tokens=NEW_TOKENS, ignore_eos=True)
        warm = c.chat(messages, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = list(cold.prompt_token_ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered
    check(arch, ids, cold)
    assert warm.token_ids == cold.token_ids and warm.usage.cached_tokens >= len(ids) - 16


def test_max_tokens_one(arch_stack: LocalStack) -> None:
    ids = tokens(40, seed=40)
    with Client(arch_stack.addr, timeout_s=60) as c:
        for _ in range(2):
            r = greedy(c, ids, 1)
            assert list(r.token_ids) == oracle(arch_stack.arch, ids, 1)[0] and r.finish_reason == "length"


@dataclass
class RefusingStore(FakeStore):
    """A FakeStore that is down (UNAVAILABLE) for each put that `refuses(keys, ephemeral)`."""

    refuses: Callable[[list[bytes], bool], bool] = lambda keys, ephemeral: False

    def put(self, blocks: Iterable[tuple[bytes, bytes]], ephemeral: bool = False) -> int:
        items = list(blocks)
        if self.refuses([k for k, _ in items], ephemeral):
            self.calls.append("put")
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        return super().put(items, ephemeral)


@pytest.mark.parametrize("arch", ARCHS)
def test_store_down_during_the_put_of_generated_blocks(arch: str) -> None:
    ids = tokens(40, seed=41)
    root = engine(arch).namespace().root()
    prompt_keys = set(prefix_hashes(ids, BLOCK_SIZE, root))
    # Down for the one put that carries blocks past the prompt's: decode's, of the reply's tokens.
    store = RefusingStore(refuses=lambda keys, ephemeral: not ephemeral and not set(keys) <= prompt_keys)
    s = LocalStack(arch, store=store)
    try:
        with Client(s.addr, timeout_s=60) as c:
            r = greedy(c, ids, 30)
            check(arch, ids, r, 30)
            assert s.decode_metric("kvserve_decode_store_failures_total", op="put") == 1
            # The last token's KV is never computed: 40 + 29 tokens hold 4 full blocks, 2 of them new.
            reply_keys = prefix_hashes([*ids, *r.token_ids[:-1]], BLOCK_SIZE, root)[len(ids) // BLOCK_SIZE :]
            assert len(reply_keys) == 2 and not set(reply_keys) & set(store.blocks)
            store.refuses = lambda keys, ephemeral: False
            again = greedy(c, ids, 30)
        assert again.token_ids == r.token_ids and again.usage.cached_tokens == 32
        assert set(reply_keys) <= store.persistent_keys()  # stored by the second request
        assert s.decode_metric("kvserve_decode_store_failures_total", op="put") == 1
    finally:
        s.close()


# --- prefill and decode configured differently ---------------------------------------------------


def test_different_block_sizes_are_refused() -> None:
    s = LocalStack("llama", block_size=16, decode_block_size=8)
    try:
        with Client(s.addr, timeout_s=60) as c, pytest.raises(FailedPreconditionError) as info:
            greedy(c, tokens(45, seed=50), 12)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "block size 16 there, 8 here" in info.value.details and "--block-size" in info.value.details
        assert s.decode_metric("kvserve_decode_generated_tokens_total") == 0
    finally:
        s.close()


def test_different_models_are_refused() -> None:
    s = LocalStack("qwen2", decode_arch="llama")
    try:
        with Client(s.addr, timeout_s=60) as c, pytest.raises(FailedPreconditionError) as info:
            greedy(c, tokens(40, seed=51), 8)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "model" in info.value.details and "--model" in info.value.details
        assert s.decode_metric("kvserve_decode_generated_tokens_total") == 0
    finally:
        s.close()
