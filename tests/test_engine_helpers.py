"""Engine helpers the services share: blocks from store payloads, a decode step that isolates a
failing sequence, and the number of tokens a request may generate."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, StepFailed
from engine.kv_codec import BlockError, encode_block
from engine.model import DEFAULT_MAX_NEW_TOKENS, ContextLengthError, max_new_tokens
from tests.engine_fixtures import random_tokens, tiny_model
from tests.model_faults import FaultyForward, at_position

BLOCK = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model("llama"), block_size=BLOCK)


def test_load_leading_and_tail_round_trip_a_prefill(engine: Engine) -> None:
    ids = random_tokens(3 * BLOCK + 5, seed=1)
    ns = engine.namespace()
    result = engine.prefill(ids)
    assert result.tail is not None
    payloads: list[bytes | None] = [encode_block(kv, ns) for kv in result.new_blocks]
    loaded = engine.load_leading(payloads, ns)
    assert loaded.error is None
    assert all(torch.equal(a, b) for a, b in zip(loaded.blocks, result.new_blocks, strict=True))
    assert torch.equal(engine.load_tail(encode_block(result.tail, ns), ns, 5), result.tail)
    with pytest.raises(BlockError) as info:
        engine.load_tail(encode_block(result.tail, ns), engine.namespace("other tenant"), 5)
    assert info.value.kind == "namespace"
    assert engine.load_leading(payloads, engine.namespace("other tenant")).blocks == []


def test_a_failing_sequence_does_not_cost_the_others_their_step() -> None:
    prompts = [random_tokens(9 + i, seed=10 + i) for i in range(3)]
    fault = FaultyForward()
    engine = Engine(fault.around(tiny_model("llama")), block_size=BLOCK)
    alone = [engine.decode_step([engine.prefill(p).sequence], [7])[0] for p in prompts]
    seqs = [engine.prefill(p).sequence for p in prompts]
    fault.fails = at_position(len(prompts[1]))  # the step feeds positions 9, 10 and 11: prompt 1's fails
    with pytest.raises(StepFailed) as info:
        engine.decode_step(seqs, [7, 7, 7])
    assert fault.num_faults == 1
    assert list(info.value.errors) == [1] and "injected fault" in str(info.value)
    logits = info.value.logits
    assert torch.allclose(logits[0], alone[0]) and torch.allclose(logits[2], alone[2])
    assert torch.isnan(logits[1]).all()
    assert [len(s.token_ids) for s in seqs] == [len(prompts[0]) + 1, len(prompts[1]), len(prompts[2]) + 1]
    engine.release(seqs[0])
    with pytest.raises(ValueError, match="released"):  # misuse: refused before any work
        engine.decode_step(seqs, [7, 7, 7])
    assert len(seqs[2].token_ids) == len(prompts[2]) + 1


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
