import pytest
import torch

from engine.engine import Engine, PrefillResult
from engine.kv_codec import decode_block, encode_block
from tests.engine_fixtures import ARCHS, random_tokens, tiny_model

BLOCK = 8
PROMPT = random_tokens(61, seed=1)  # 7 full blocks of 8 and a tail of 5


def _engine(arch: str) -> Engine:
    return Engine(tiny_model(arch), block_size=BLOCK)


def _through_codec(engine: Engine, blocks: list[torch.Tensor], num_tokens: int | None = BLOCK) -> list[torch.Tensor]:
    m, ns = engine.model, engine.namespace()
    shape = {"num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim}
    return [decode_block(encode_block(b, ns), ns, **shape, dtype=m.dtype, num_tokens=num_tokens) for b in blocks]


@pytest.fixture(scope="module", params=ARCHS)
def cold(request: pytest.FixtureRequest) -> tuple[Engine, PrefillResult]:
    engine = _engine(request.param)
    return engine, engine.prefill(PROMPT)


def test_cold_prefill_layout(cold: tuple[Engine, PrefillResult]) -> None:
    engine, result = cold
    m = engine.model
    assert (result.num_cached_tokens, result.num_computed_tokens) == (0, 61)
    assert len(result.new_blocks) == 7
    assert all(b.shape == (m.num_layers, 2, m.num_kv_heads, BLOCK, m.head_dim) for b in result.new_blocks)
    assert result.tail is not None and result.tail.shape[3] == 5
    assert result.logits.shape == (m.vocab_size,) and result.logits.dtype == torch.float32
    assert result.sequence.token_ids == PROMPT


@pytest.mark.parametrize("num_cached_blocks", [1, 3, 7])
@pytest.mark.parametrize("codec", [False, True])
def test_prefill_over_cached_blocks_equals_full_prefill(
    cold: tuple[Engine, PrefillResult], num_cached_blocks: int, codec: bool
) -> None:
    engine, full = cold
    cached = full.new_blocks[:num_cached_blocks]
    if codec:
        cached = _through_codec(engine, cached)
    warm = engine.prefill(PROMPT, cached)
    assert (warm.num_cached_tokens, warm.num_computed_tokens) == (8 * num_cached_blocks, 61 - 8 * num_cached_blocks)
    torch.testing.assert_close(warm.logits, full.logits, atol=1e-4, rtol=0)
    assert len(warm.new_blocks) == 7 - num_cached_blocks
    for new, ref in zip(warm.new_blocks, full.new_blocks[num_cached_blocks:], strict=True):
        torch.testing.assert_close(new, ref, atol=1e-4, rtol=0)
    assert warm.tail is not None and full.tail is not None
    torch.testing.assert_close(warm.tail, full.tail, atol=1e-4, rtol=0)


def test_block_aligned_prompt_has_no_tail_and_must_compute_last_token(cold: tuple[Engine, PrefillResult]) -> None:
    engine, full = cold
    aligned = PROMPT[:56]
    result = engine.prefill(aligned, full.new_blocks[:6])
    assert result.tail is None and len(result.new_blocks) == 1 and result.num_computed_tokens == 8
    with pytest.raises(ValueError, match="last prompt token"):
        engine.prefill(aligned, full.new_blocks[:7])
    with pytest.raises(ValueError):
        engine.prefill(PROMPT, [full.new_blocks[0][:, :, :, :4]])  # a short block is not a full block


def test_resume_then_decode_equals_continuing_the_prefilled_sequence() -> None:
    engine = _engine("qwen2")
    prefilled = engine.prefill(PROMPT)
    blocks = _through_codec(engine, prefilled.new_blocks)
    assert prefilled.tail is not None
    (tail,) = _through_codec(engine, [prefilled.tail], num_tokens=None)
    resumed = engine.resume(PROMPT, blocks, tail)
    a = engine.decode_step([prefilled.sequence], [42])
    b = engine.decode_step([resumed], [42])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert resumed.token_ids == [*PROMPT, 42]
    with pytest.raises(ValueError):
        engine.resume(PROMPT[:-1], blocks, tail)


def test_decode_step_batch_and_full_blocks() -> None:
    engine = _engine("llama")
    one, two = engine.prefill(PROMPT[:20]).sequence, engine.prefill(PROMPT[:13]).sequence
    solo = engine.prefill(PROMPT[:13]).sequence
    batched = engine.decode_step([one, two], [5, 6])  # [2, vocab]
    assert batched.shape == (2, engine.model.vocab_size) and batched.dtype == torch.float32
    torch.testing.assert_close(batched[1], engine.decode_step([solo], [6])[0], atol=1e-5, rtol=0)
    for token in range(4):  # 21 -> 25 tokens: 3 full blocks
        engine.decode_step([one], [token])
    assert len(one.token_ids) == 25
    blocks = engine.full_blocks(one, start_block=2)
    assert len(blocks) == 1
    reference = engine.prefill(one.token_ids).new_blocks[2]
    torch.testing.assert_close(blocks[0], reference, atol=1e-4, rtol=0)
    engine.release(one)
    with pytest.raises(ValueError, match="released"):
        engine.decode_step([one], [1])
