"""The batched engine against the oracle: every stream of a batch generates, greedily, what Hugging Face
``generate`` gives for its token ids alone (docs/DESIGN.md, "Models"), however the engine packs, chunks,
preempts, reuses and resumes it. A mismatch is allowed only at a near-tie of the oracle's logits.

Every run ends with the pool intact and no block left in use (``tests.engine_fixtures.finish``).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from kvserve.engine import native
from kvserve.engine.engine import RequestTooLarge, StepStats
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.model import load_model
from kvserve.engine.model_runner import MIN_SHARED_BLOCKS, LastLayerRows, shared_blocks
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.sequence import Finished
from kvserve.engine.sequence import Sequence as KVSequence
from tests.engine_fixtures import (
    ARCHS,
    DictStore,
    PrefixSource,
    assert_matches_oracle,
    finish,
    make_engine,
    make_seq,
    oracle,
    random_tokens,
    run,
    tiny_model,
    tiny_model_path,
)
from tests.model_faults import FaultyForward, at_position

BLOCK = 8
MAX_NEW = 12


def _prompts(n: int, seed: int = 0, shortest: int = 3, spread: int = 120) -> list[list[int]]:
    """``n`` prompts of different lengths in ``shortest .. shortest + spread - 1``."""
    return [random_tokens(shortest + (37 * i + seed) % spread, seed=1000 * seed + i) for i in range(n)]


class StepLog:
    """An ``on_step`` callback that keeps every step's stats."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats)

    @property
    def num_preempted(self) -> int:
        return sum(s.num_preempted for s in self.steps)


@pytest.mark.parametrize("num_streams", [1, 8, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_streams_equal_hf_generate(arch: str, num_streams: int) -> None:
    model = tiny_model(arch)
    log = StepLog()
    engine = make_engine(model, BLOCK, 1024, on_step=log)
    seqs = [make_seq(model, p, MAX_NEW) for p in _prompts(num_streams)]
    outcomes = run(engine, seqs)
    assert max(s.num_seqs for s in log.steps) == num_streams  # every stream decoded in the same forward
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_streams_join_a_running_batch() -> None:
    model = tiny_model("qwen2")
    log = StepLog()
    engine = make_engine(model, BLOCK, 256, on_step=log)
    prompts = _prompts(8, seed=1, spread=50)
    first = [make_seq(model, p, MAX_NEW) for p in prompts[:4]]
    later = [make_seq(model, p, MAX_NEW) for p in prompts[4:]]
    for seq in first:
        engine.add(seq)
    for _ in range(4):
        engine.step()
    assert [s.num_new_tokens for s in first] == [4] * 4
    num_steps_before = len(log.steps)
    for seq in later:
        engine.add(seq)
    outcomes = finish(engine, first + later)
    assert max(s.num_seqs for s in log.steps[num_steps_before:]) == 8  # the newcomers ran beside the others
    for seq, outcome in zip(first + later, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


@pytest.mark.parametrize("resume_from", ["store", "recompute", "pool"])
@pytest.mark.parametrize("arch", ARCHS)
def test_preempted_streams_resume_and_equal_hf_generate(arch: str, resume_from: str) -> None:
    """8 streams growing to 7-11 blocks each in a pool of 24: decoding runs out of blocks, the newest
    streams are preempted and later resume from the store, by recomputing, or from the pool's cached blocks."""
    model = tiny_model(arch)
    log = StepLog()
    engine = make_engine(model, BLOCK, 24, on_step=log)
    source = PrefixSource(DictStore(), engine.namespace()) if resume_from == "store" else None
    hash_root = engine.namespace().root() if resume_from == "pool" else None
    seqs = [make_seq(model, p, 24, source=source, hash_root=hash_root) for p in _prompts(8, seed=2, shortest=20,
                                                                                         spread=41)]
    outcomes = run(engine, seqs)
    preempted = [s for s in seqs if s.stats.num_preemptions]
    assert preempted and sum(s.stats.num_preemptions for s in seqs) == log.num_preempted
    assert all(step.pool_used <= engine.pool.num_blocks for step in log.steps)
    if resume_from == "store":
        assert source is not None
        # Resumed from the full blocks its preemption saved; only preempted sequences found any.
        assert all(s.stats.num_loaded_tokens > 0 and s.stats.num_loaded_tokens % BLOCK == 0 for s in preempted)
        assert {ld.seq_id for ld in source.loads if ld.num_tokens} == {s.seq_id for s in preempted}
    elif resume_from == "pool":  # its blocks were kept by hash when it was preempted
        assert all(s.stats.num_pool_hit_tokens > 0 and s.stats.num_loaded_tokens == 0 for s in preempted)
    if resume_from == "recompute":
        assert all(s.stats.num_engine_computed_tokens > s.num_prompt_tokens for s in preempted)
        assert all(s.stats.num_loaded_tokens == s.stats.num_pool_hit_tokens == 0 for s in seqs)
    else:  # no prompt token computed twice
        assert all(s.stats.num_engine_computed_tokens == s.num_prompt_tokens for s in seqs)
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


@pytest.mark.parametrize("budget", [16, 32])
@pytest.mark.parametrize("arch", ARCHS)
def test_long_prompts_computed_in_chunks_between_decode_rows(arch: str, budget: int) -> None:
    model = tiny_model(arch)
    short = [make_seq(model, p, 24) for p in (random_tokens(6, seed=30), random_tokens(11, seed=31))]
    long = [make_seq(model, p, MAX_NEW) for p in (random_tokens(301, seed=32), random_tokens(213, seed=33))]
    seqs = short + long
    # (short streams' tokens so far, long prompts' computed tokens) after each step
    progress: list[tuple[int, list[int]]] = []

    def observe(stats: StepStats) -> None:
        assert stats.num_tokens <= budget
        progress.append((sum(s.num_new_tokens for s in short), [s.num_computed_tokens for s in long]))

    engine = make_engine(model, BLOCK, 256, max_num_batched_tokens=budget, max_num_seqs=budget, on_step=observe)
    outcomes = run(engine, seqs)
    assert len(progress) >= (301 + 213) // budget
    interleaved = [
        now for before, now in zip(progress, progress[1:], strict=False)
        if now[0] > before[0] and any(0 < c < len(s.token_ids) - s.num_new_tokens for c, s in zip(now[1], long,
                                                                                                 strict=True))
    ]
    assert interleaved, "no short stream decoded while a long prompt was half computed"
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_shared_prefix_is_taken_from_the_pool(arch: str) -> None:
    model = tiny_model(arch)
    log = StepLog()
    engine = make_engine(model, BLOCK, 64, on_step=log)
    root = engine.namespace().root()
    prompt = random_tokens(45, seed=40)
    first = make_seq(model, prompt, MAX_NEW, hash_root=root)
    run(engine, [first])
    assert engine.pool.num_cached == (45 + MAX_NEW - 1) // BLOCK  # every full block computed, kept by hash

    # Another user's prompt sharing the first 40 tokens (5 blocks), and the next turn of the first chat.
    other = make_seq(model, [*prompt[:40], *random_tokens(10, seed=41)], MAX_NEW, hash_root=root)
    next_turn = make_seq(model, [*first.token_ids, *random_tokens(5, seed=42)], MAX_NEW, hash_root=root)
    steps_before = len(log.steps)
    outcomes = run(engine, [other, next_turn])
    assert (other.stats.num_pool_hit_tokens, other.stats.num_engine_computed_tokens) == (40, 10)
    assert (next_turn.stats.num_pool_hit_tokens, next_turn.stats.num_engine_computed_tokens) == (56, 6)
    assert sum(s.num_pool_hit_tokens for s in log.steps[steps_before:]) == 96
    for seq, outcome in zip([other, next_turn], outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


@pytest.mark.parametrize("arch", ARCHS)
def test_streams_over_a_shared_system_prompt_read_it_once_and_equal_hf_generate(arch: str) -> None:
    model = tiny_model(arch)
    engine = make_engine(model, BLOCK, 256)
    root = engine.namespace().root()
    system = random_tokens((MIN_SHARED_BLOCKS + 3) * BLOCK + 5, seed=50)
    run(engine, [make_seq(model, system, 1, hash_root=root)])  # the system prompt, cached by hash
    # users' questions of different lengths after it, one whose question ends on a block boundary
    seqs = [make_seq(model, [*system, *random_tokens(n, seed=51 + n)], MAX_NEW, hash_root=root)
            for n in (3, 11, 2 * BLOCK - 5)]
    for seq in seqs:
        engine.add(seq)
    while not all(len(s.token_ids) - s.num_computed_tokens == 1 and s.num_new_tokens for s in seqs):
        engine.step()
    # the decode rows read the system prompt's full blocks once, together
    tables, lens = [s.block_table for s in seqs], [len(s.token_ids) for s in seqs]
    assert shared_blocks(tables, lens, BLOCK) == len(system) // BLOCK
    outcomes = finish(engine, seqs)
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_shared_blocks_are_the_common_leading_full_blocks() -> None:
    m = MIN_SHARED_BLOCKS
    common = list(range(100, 100 + m + 2))
    a, b = [*common, 1, 2], [*common, 3]
    assert shared_blocks([a, b], [len(a) * BLOCK, len(b) * BLOCK], BLOCK) == m + 2
    assert shared_blocks([a], [len(a) * BLOCK], BLOCK) == 0  # one row: nothing to share
    assert shared_blocks([a, b], [len(a) * BLOCK, (m + 2) * BLOCK], BLOCK) == m + 1  # b's last block is its own
    assert shared_blocks([a, [*common[: m - 1], 7, 8, 9]], [len(a) * BLOCK, 99 * BLOCK], BLOCK) == 0  # too few


def test_a_running_sequence_shares_its_blocks_and_a_whole_prompt_keeps_its_last_token() -> None:
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 64)
    root = engine.namespace().root()
    prompt = random_tokens(48, seed=43)  # 6 full blocks
    first = make_seq(model, prompt, MAX_NEW, hash_root=root)
    engine.add(first)
    engine.step()
    engine.step()
    assert first.num_new_tokens == 2
    same = make_seq(model, prompt, MAX_NEW, hash_root=root)
    engine.add(same)
    engine.step()
    # The pool holds all 6 blocks, in use by ``first``; the last prompt token is computed all the same.
    assert (same.stats.num_pool_hit_tokens, same.stats.num_engine_computed_tokens) == (40, 8)
    assert same.block_table[:5] == first.block_table[:5] and same.block_table[5] != first.block_table[5]
    a, b = finish(engine, [first, same])
    assert a.tokens == b.tokens
    assert_matches_oracle(model, first, a)


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch() -> None:
    model = tiny_model("llama")
    prompt = random_tokens(30, seed=50)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1234)
    (alone,) = run(make_engine(model, BLOCK, 128), [make_seq(model, prompt, 16, params)])

    others = _prompts(6, seed=5)
    batch = [
        make_seq(model, others[0], 16),
        make_seq(model, others[1], 16, SamplingParams(temperature=1.0, seed=1)),
        make_seq(model, prompt, 16, params),
        make_seq(model, others[2], 16, SamplingParams(temperature=0.7, top_k=5, seed=1234)),
        make_seq(model, prompt, 16, SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=4321)),
        *(make_seq(model, p, 16, SamplingParams(temperature=1.3, top_p=0.5)) for p in others[3:]),
    ]
    outcomes = run(make_engine(model, BLOCK, 128), batch)
    assert outcomes[2].tokens == alone.tokens
    assert outcomes[4].tokens != alone.tokens  # the seed decides
    assert all(o.finished == Finished("length") and len(o.tokens) == 16 for o in outcomes)


def test_a_request_larger_than_the_pool_is_refused_at_add() -> None:
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 10)  # 80 tokens
    with pytest.raises(RequestTooLarge, match="need 11 KV blocks of 8 tokens; the KV pool holds 10"):
        engine.add(make_seq(model, random_tokens(70, seed=60), 11))
    assert not engine.scheduler.has_work
    fits = make_seq(model, random_tokens(70, seed=60), 10)
    (outcome,) = run(engine, [fits])
    assert_matches_oracle(model, fits, outcome)


@pytest.mark.parametrize("where", ["prompt", "decode"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_failing_forward_fails_only_its_sequence(arch: str, where: str) -> None:
    """Prompts of 9, 12 and 40 tokens generate 8 each: positions up to 15, 18 and 46. A forward computing
    position 25 (the long prompt) or 43 (its fourth generated token) fails; only that sequence ends."""
    fault = FaultyForward(at_position(25 if where == "prompt" else 43))
    model = fault.around(load_model(tiny_model_path(arch)))  # not the shared model: the engine keeps it wrapped
    engine = make_engine(model, BLOCK, 64)
    seqs = [make_seq(model, random_tokens(n, seed=70 + n), 8) for n in (9, 12, 40)]
    *fine, failed = run(engine, seqs)
    assert fault.num_faults >= 1
    assert failed.finished.reason == "error" and "injected fault" in failed.finished.error
    oracle_tokens, _ = oracle(tiny_model(arch), seqs[2].token_ids[:40], 8)
    assert failed.tokens == ([] if where == "prompt" else oracle_tokens[:4])
    for seq, outcome in zip(seqs[:2], fine, strict=True):
        assert_matches_oracle(tiny_model(arch), seq, outcome)


@pytest.mark.slow
def test_many_long_requests_in_a_quarter_of_their_memory() -> None:
    """48 requests of 1,500 prompt tokens + 64 generated, in a pool holding a quarter of them: all finish,
    the pool is never overrun, preempted requests resume from the store, and every output is the oracle's."""
    model = tiny_model("llama")
    bs, prompt_len, new = 16, 1500, 64
    per_request = math.ceil((prompt_len + new) / bs)
    # A quarter, less a few blocks: twelve requests that exactly fit would never be preempted (admission keeps
    # a block of headroom per running sequence), twelve that almost fit run out of blocks as they decode.
    num_blocks = 48 * per_request // 4 - 12
    log = StepLog()
    running: list[int] = []

    def observe(stats: StepStats) -> None:
        log(stats)
        running.append(len(engine.scheduler.running))
        in_tables = sum(len(s.block_table) for s in engine.scheduler.running)
        assert stats.pool_used <= engine.pool.num_blocks and in_tables <= engine.pool.num_blocks

    engine = make_engine(model, bs, num_blocks, max_num_batched_tokens=1024, on_step=observe)
    source = PrefixSource(DictStore(), engine.namespace())
    seqs: list[KVSequence] = [make_seq(model, random_tokens(prompt_len, seed=100 + i), new, source=source)
                              for i in range(48)]
    outcomes = run(engine, seqs)
    engine.stop()
    assert log.num_preempted > 0 and max(running) < 48
    preempted = [s for s in seqs if s.stats.num_preemptions]
    assert all(s.stats.num_loaded_tokens >= prompt_len // bs * bs for s in preempted)
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_a_shared_prompts_kept_keys_and_values_are_read_only_while_the_same_prompt_is_shared() -> None:
    """Without engine.native's kernel, the shared blocks' gathered KV is kept across steps (SharedPrefixKV) under
    the blocks' ids and the prefix hash of the last: another system prompt is read from its own blocks, and the
    same ids holding another prefix make another key."""
    model = tiny_model("llama")
    system_len = (MIN_SHARED_BLOCKS + 2) * BLOCK
    engine = make_engine(model, BLOCK, num_blocks=64)
    engine.runner.in_place_decode = False  # as where the kernel cannot be built
    engine.runner.shared_kv.max_bytes = engine.kv_cache.kv.nbytes  # kept, however small the pool
    root = engine.namespace().root()
    kept: list[tuple[object, ...] | None] = []
    for phase in range(2):
        system = random_tokens(system_len, seed=60 + phase)
        seqs = [make_seq(model, [*system, *random_tokens(8, seed=70 + 10 * phase + i)], MAX_NEW, hash_root=root)
                for i in range(3)]
        for seq in seqs:
            engine.add(seq)
        while not all(s.num_new_tokens >= 2 for s in seqs):
            engine.step()
        kept.append(engine.runner.shared_kv.key)
        for seq, outcome in zip(seqs, finish(engine, seqs), strict=True):
            assert_matches_oracle(model, seq, outcome)
    assert None not in kept and kept[0] != kept[1]
    n = MIN_SHARED_BLOCKS
    one, other = (make_seq(model, random_tokens(n * BLOCK, seed=80 + i), 1, hash_root=root) for i in range(2))
    for seq in (one, other):
        seq.block_table = list(range(n))
        seq.full_block_hashes(BLOCK, n)
    assert engine.runner.shared_key(one, n) != engine.runner.shared_key(other, n)
    one.block_hashes = []  # never hashed: not kept
    assert engine.runner.shared_key(one, n) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_the_last_layer_computes_only_the_sampled_rows(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Hugging Face's modules, a prompt chunk's last layer runs its MLP over the rows whose logits are
    sampled: none for a chunk in the middle of a prompt, one for the chunk that ends it, one per decode row
    beside it; every other layer over every token. The tokens still equal the oracle's (KV of every token is
    written in every layer)."""
    monkeypatch.setenv("KVSERVE_MODEL_CODE", "hf")
    model = tiny_model(arch)
    engine = make_engine(model, BLOCK, 64, max_num_batched_tokens=16, max_num_seqs=4)  # hooks first, then ours
    layers = [m for m in model.hf_model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)]
    first_mlp, last_mlp = layers[0].mlp, layers[-1].mlp
    seen: dict[str, list[int]] = {"first": [], "last": []}
    hooks = [first_mlp.register_forward_pre_hook(lambda _m, a: seen["first"].append(a[0].shape[1])),
             last_mlp.register_forward_pre_hook(lambda _m, a: seen["last"].append(a[0].shape[1]))]
    try:
        assert engine.runner.last_layer_rows is LastLayerRows.of(model.hf_model)  # its hooks registered once
        alone = make_seq(model, random_tokens(40, seed=7), 3)
        (outcome,) = run(engine, [alone])
        # 40 prompt tokens in steps of 16, 16 and 8 (the first token sampled there), then 2 decode steps
        assert (seen["first"], seen["last"]) == ([16, 16, 8, 1, 1], [0, 0, 1, 1, 1])
        assert_matches_oracle(model, alone, outcome)

        seen["first"].clear()
        seen["last"].clear()
        short, long = make_seq(model, random_tokens(6, seed=8), 5), make_seq(model, random_tokens(40, seed=9), 3)
        outcomes = run(engine, [short, long])
        # short's 6 tokens and 10 of long's; short decoding beside 15 of long's, twice (long's first token
        # sampled in the second); then both decode, every row sampled
        assert (seen["first"], seen["last"]) == ([16, 16, 16, 2, 2], [1, 1, 2, 2, 2])
        for seq, out in zip([short, long], outcomes, strict=True):
            assert_matches_oracle(model, seq, out)
    finally:
        for h in hooks:
            h.remove()


chunk_kernel = native.chunk_kernel()
needs_chunk_kernel = pytest.mark.skipif(chunk_kernel is None, reason="no C kernels here")


@needs_chunk_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "tokens", "context"), [
    (9, 3, 64, 16, 53, 245),  # grouped-query heads over earlier context (SmolLM2's shape), a tile's lanes span tokens
    (9, 3, 64, 16, 40, 40),  # a prompt's first chunk: its own keys alone
    (9, 3, 64, 16, 1, 245),  # the last layer's sampled row: every key
    (4, 4, 128, 16, 21, 37),  # no grouping; 128-wide heads
    (8, 2, 32, 5, 33, 71),  # a block size and head size of no specialised kernel
])
def test_the_chunk_kernel_equals_sdpa_over_the_gathered_context(heads: int, kv_heads: int, head_dim: int,
                                                                block_size: int, tokens: int, context: int) -> None:
    assert chunk_kernel is not None
    g = torch.Generator().manual_seed(tokens)
    blocks = -(-context // block_size)
    cache = KVCache(blocks + 7, num_layers=3, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=torch.float32)
    cache.kv.normal_(generator=g)
    table = torch.randperm(blocks + 7, generator=g)[:blocks]
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g)  # queries as the own forward has them
    q = qkv[:, :heads]
    got = chunk_kernel(q, cache.kv, 1, table, context, 0.3)
    k, v = (cache.layer(1, kind)[table].reshape(-1, kv_heads, head_dim)[:context].transpose(0, 1)[None]
            for kind in (0, 1))
    mask = torch.arange(context)[None, :] <= torch.arange(context - tokens, context)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                                             scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want[0].transpose(0, 1))


@needs_chunk_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "tokens", "context"), [
    (9, 3, 64, 16, 53, 245),
    (8, 2, 32, 5, 33, 71),
])
def test_the_chunk_kernel_reads_a_bfloat16_cache_as_its_values_in_float32(
        heads: int, kv_heads: int, head_dim: int, block_size: int, tokens: int, context: int) -> None:
    assert chunk_kernel is not None
    g = torch.Generator().manual_seed(tokens)
    blocks = -(-context // block_size)
    cache = KVCache(blocks + 7, num_layers=3, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=torch.bfloat16)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    table = torch.randperm(blocks + 7, generator=g)[:blocks]
    q = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).bfloat16()[:, :heads]
    got = chunk_kernel(q, cache.kv, 1, table, context, 0.3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, chunk_kernel(q.float(), cache.kv.float(), 1, table, context, 0.3), rtol=0, atol=0)


@needs_chunk_kernel
def test_the_chunk_kernel_refuses_what_lies_outside_the_cache() -> None:
    assert chunk_kernel is not None
    cache = KVCache(4, num_layers=2, block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    q = torch.zeros(3, 2, 16)
    for table, context, layer in [(torch.tensor([0, 4]), 8, 0),  # block 4 of 4
                                  (torch.tensor([0, -1]), 8, 0),
                                  (torch.tensor([0, 1]), 9, 0),  # past the table
                                  (torch.tensor([0, 1]), 2, 0),  # 3 queries, 2 positions
                                  (torch.tensor([0, 1]), 8, 2)]:  # layer 2 of 2
        with pytest.raises(ValueError, match="outside the cache"):
            chunk_kernel(q, cache.kv, layer, table, context, 1.0)


@needs_chunk_kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_a_chat_turn_over_its_history_reads_it_in_place_and_equals_hf_generate(
        arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn's new tokens over the history in the pool, in chunks of the token budget beside a decoding stream:
    each chunk's attention runs through the C kernel, over the blocks where they lie, and the tokens equal the
    oracle's."""
    assert chunk_kernel is not None
    model = tiny_model(arch)
    shapes: list[tuple[int, int]] = []

    def spy(q: torch.Tensor, kv: torch.Tensor, layer: int, table: torch.Tensor, context: int,
            scale: float) -> torch.Tensor:
        shapes.append((q.shape[0], context))  # (chunk tokens, context)
        return chunk_kernel(q, kv, layer, table, context, scale)

    monkeypatch.setattr(native, "chunk_kernel", lambda: spy)
    engine = make_engine(model, BLOCK, 128, max_num_batched_tokens=64)
    root = engine.namespace().root()
    first = make_seq(model, random_tokens(90, seed=60), MAX_NEW, hash_root=root)
    run(engine, [first])
    shapes.clear()
    turn = make_seq(model, [*first.token_ids, *random_tokens(140, seed=61)], MAX_NEW, hash_root=root)
    other = make_seq(model, random_tokens(5, seed=62), 3 * MAX_NEW)
    outcomes = run(engine, [other, turn])
    assert turn.stats.num_pool_hit_tokens == 96  # the 101 tokens with KV (90 and 11 generated): 12 full blocks
    # 146 new tokens in steps of 64: 59 beside the other prompt's 5, 63 beside its decode row, then 24; each
    # (tokens, context) in every layer but the last, which computes a chunk's sampled row alone
    layers = model.num_layers - 1
    turn_chunks = [(n, ctx) for n, ctx in shapes if ctx > 5]
    assert turn_chunks == [(59, 96 + 59)] * layers + [(63, 96 + 59 + 63)] * layers + [(24, 242)] * layers + [(1, 242)]
    assert shapes.count((5, 5)) == layers and (1, 5) in shapes  # the other prompt, its first token sampled
    for seq, outcome in zip([other, turn], outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_step_stats_time_the_forward_and_the_step_threads_time_off_its_core(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    log = StepLog()
    engine = make_engine(model, BLOCK, 256, on_step=log)
    run(engine, [make_seq(model, p, MAX_NEW) for p in _prompts(4)])
    forwards = [s for s in log.steps if s.num_seqs]
    assert forwards and all(0.0 <= s.off_core_s <= s.forward_s and s.forward_s > 0 for s in forwards)
    assert all(s.forward_s == s.off_core_s == 0.0 for s in log.steps if not s.num_seqs)

    # A forward whose thread leaves its core for 20 ms (as it does waiting for a core another thread holds)
    forward = engine.runner.run

    def slow(scheduled: list[tuple[KVSequence, int]]) -> dict[KVSequence, int]:
        tokens = forward(scheduled)
        time.sleep(0.02)
        return tokens

    monkeypatch.setattr(engine.runner, "run", slow)
    log.steps.clear()
    run(engine, [make_seq(model, _prompts(1, seed=3)[0], 2)])
    forwards = [s for s in log.steps if s.num_seqs]
    assert len(forwards) == 2 and all(0.02 <= s.off_core_s <= s.forward_s for s in forwards)
