"""The engine on CUDA, in the half-precision dtypes models are served in: the paged KV cache and the packed,
batched step (with chunked prompts and preemptions) against the oracle run on the same CUDA model, KV
moving between CUDA KV caches through the block codec, and seeded sampling with a CUDA generator.
Skipped where CUDA is absent."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from kvserve.engine.hashing import Namespace
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.model import Model, load_model
from kvserve.engine.sampling import SamplingParams
from kvserve.handoff.transfer import load_blocks, save_blocks
from protos.block_hash import BlockHash
from tests.engine_fixtures import (
    ARCHS,
    DictStore,
    PrefixSource,
    assert_matches_oracle,
    make_engine,
    make_seq,
    random_tokens,
    run,
    tiny_model_path,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
BLOCK = 16
HALF = [torch.bfloat16, torch.float16]
# Near-tie gaps: a few units in the last place of logits of magnitude 2-4 (bf16: 1/64, fp16: 1/256). Batched
# kernels round differently from the oracle's; only a mismatch where the oracle's top two are that close
# is allowed, and eight streams must all pass.
NEAR_TIE = {torch.bfloat16: 0.1, torch.float16: 0.03}


@cache
def _model(arch: str, dtype: torch.dtype) -> Model:
    return load_model(tiny_model_path(arch), device=DEVICE, dtype=dtype)


def _prompts(n: int) -> list[list[int]]:
    return [random_tokens(10 + (37 * i) % 100, seed=200 + i) for i in range(n)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_streams_on_cuda_equal_hf_generate(arch: str, dtype: torch.dtype) -> None:
    """8 streams of 10-109 prompt tokens generating 32 each, prompts in chunks of 32 tokens, a pool of 12
    blocks of 16: preempted streams resume from the store."""
    model = _model(arch, dtype)
    preempted: list[int] = []
    engine = make_engine(model, BLOCK, 12, max_num_batched_tokens=32, max_num_seqs=32,
                         on_step=lambda stats: preempted.append(stats.num_preempted))
    assert engine.kv_cache.kv.device.type == "cuda" and engine.kv_cache.kv.dtype == dtype
    source = PrefixSource(DictStore(), engine.namespace())
    seqs = [make_seq(model, p, 32, source=source) for p in _prompts(8)]
    outcomes = run(engine, seqs)
    assert sum(preempted) > 0
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome, NEAR_TIE[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_kv_moves_between_cuda_kv_caches_through_the_codec(dtype: torch.dtype) -> None:
    shape = {"num_layers": 2, "block_size": BLOCK, "num_kv_heads": 2, "head_dim": 8, "dtype": dtype}
    src, dst = KVCache(6, **shape, device=DEVICE), KVCache(6, **shape, device=DEVICE)
    src.kv.copy_(torch.randn(src.kv.shape, device=DEVICE))
    namespace = Namespace("cd" * 32, str(dtype).removeprefix("torch."), BLOCK)
    keys = [BlockHash(bytes([i]) * 32) for i in range(2)]
    tail = BlockHash(b"\xee" * 32)
    store = DictStore()
    assert save_blocks(store, keys, namespace, src.kv[[4, 1, 3]], 2 * BLOCK + 5, tail_key=tail) == 3
    loaded = load_blocks(store, keys, namespace, dst, [0, 2, 5], tail=(tail, 5))
    assert loaded.num_tokens == 2 * BLOCK + 5 and loaded.error is None
    assert torch.equal(dst.kv[0], src.kv[4]) and torch.equal(dst.kv[2], src.kv[1])
    assert torch.equal(dst.kv[5, :, :, :5], src.kv[3, :, :, :5])
    assert not dst.kv[5, :, :, 5:].any() and not dst.kv[[1, 3, 4]].any()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_prompt_over_blocks_from_another_cuda_engine(dtype: torch.dtype) -> None:
    model = _model("llama", dtype)
    prompt = random_tokens(77, seed=210)  # 4 full blocks and 13 tokens
    first = make_engine(model, BLOCK, 16)
    source = PrefixSource(DictStore(), first.namespace())
    run(first, [make_seq(model, prompt, 1, source=source)])
    second = make_engine(model, BLOCK, 16)
    seq = make_seq(model, prompt, 16, source=PrefixSource(source.store, second.namespace()))
    (outcome,) = run(second, [seq])
    assert (seq.stats.num_loaded_tokens, seq.stats.num_engine_computed_tokens) == (64, 13)
    assert_matches_oracle(model, seq, outcome, NEAR_TIE[dtype])


def test_seeded_sampling_on_cuda_gives_the_same_tokens_alone_and_in_a_batch() -> None:
    model = _model("qwen2", torch.float32)  # float32: a batch must not move a probability across a draw
    prompt = random_tokens(30, seed=220)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    (alone,) = run(make_engine(model, BLOCK, 64), [make_seq(model, prompt, 16, params)])
    batch = [make_seq(model, p, 16, SamplingParams(temperature=1.1, seed=i)) for i, p in enumerate(_prompts(6))]
    batch.insert(3, make_seq(model, prompt, 16, params))
    outcomes = run(make_engine(model, BLOCK, 64), batch)
    assert outcomes[3].tokens == alone.tokens
