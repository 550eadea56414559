"""The block pool and the scheduler over it, with tiny pools: exact blocks, exact order, and
``check_integrity()`` (free + used + cached == total) after every operation."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import abc

import pytest
import torch

from kvserve.engine.block_pool import BlockPool, PoolExhausted, check_pool_state
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.sampling import Sampler, SamplingParams
from kvserve.engine.scheduler import Schedule, Scheduler, SchedulerConfig, Spill
from kvserve.engine.sequence import Sequence, Status
from protos.block_hash import BlockHash

ROOT = BlockHash(hashlib.sha256(b"test_block_pool").digest())


def _h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def _pool(num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks)
    pool.check_integrity()
    return pool


def _counts(pool: BlockPool) -> tuple[int, int, int]:
    """(free, used, cached), after checking that they add up."""
    pool.check_integrity()
    return pool.num_free, pool.num_used, pool.num_cached


# ---- the pool ------------------------------------------------------------------------------


def test_allocate_takes_free_blocks_in_order_and_free_returns_them_tail_first() -> None:
    pool = _pool(4)
    assert pool.allocate(2) == [0, 1]
    assert _counts(pool) == (2, 2, 0)
    assert pool.allocate(1) == [2]
    assert _counts(pool) == (1, 3, 0)
    pool.free([0, 1])  # released in reverse: 1, then 0, behind the untouched 3
    assert _counts(pool) == (3, 1, 0)
    assert pool.allocate(3) == [3, 1, 0]
    assert _counts(pool) == (0, 4, 0)
    pool.free([2, 3, 1, 0])
    assert _counts(pool) == (4, 0, 0)
    assert pool.allocate(4) == [0, 1, 3, 2]
    assert pool.num_evicted == 0


def test_shared_blocks_are_freed_with_their_last_reference() -> None:
    pool = _pool(4)
    blocks = pool.allocate(2)
    pool.register(blocks[0], _h("a0"))
    pool.register(blocks[1], _h("a1"))
    assert _counts(pool) == (2, 2, 0)
    assert pool.take_hits([_h("a0"), _h("a1")]) == [0, 1]  # a second owner: refcount 2 each
    assert pool.take_hits([_h("a0")]) == [0]  # a third owner of block 0
    assert _counts(pool) == (2, 2, 0)
    pool.free([0, 1])
    assert _counts(pool) == (2, 2, 0)
    pool.free([0, 1])
    assert _counts(pool) == (2, 1, 1)  # block 1 cached, block 0 still held once
    pool.free([0])
    assert _counts(pool) == (2, 0, 2)
    with pytest.raises(AssertionError, match="freed more often than taken"):
        pool.free([3])


def test_registered_blocks_are_cached_when_freed_and_revived_by_take_hits() -> None:
    pool = _pool(4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.register(0, _h("p0"))
    pool.check_integrity()
    pool.register(1, _h("p1"))  # block 2 holds a partial tail: never registered
    pool.check_integrity()
    pool.free([0, 1, 2])
    assert _counts(pool) == (2, 0, 2)
    assert pool.count_hits([_h("p0"), _h("p1"), _h("p2")]) == 2
    assert pool.count_hits([_h("p1")]) == 1
    assert pool.count_hits([_h("x"), _h("p0")]) == 0  # a prefix stops at its first miss
    assert _counts(pool) == (2, 0, 2)  # counting takes nothing
    assert pool.take_hits([_h("p0"), _h("x"), _h("p1")]) == [0]
    assert _counts(pool) == (2, 1, 1)
    assert pool.take_hits([_h("p0"), _h("p1")]) == [0, 1]
    assert _counts(pool) == (2, 2, 0)
    assert pool.allocate(2) == [3, 2]  # revived blocks are not available to others
    assert _counts(pool) == (0, 4, 0)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert _counts(pool) == (0, 4, 0)


def test_eviction_takes_the_least_recently_freed_block_and_a_sequence_tail_first() -> None:
    pool = _pool(5)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1], [2, 3])
    for block, name in zip(a + b, ["a0", "a1", "b0", "b1"], strict=True):
        pool.register(block, _h(name))
        pool.check_integrity()
    pool.free(a)  # cached, oldest first: 1, 0
    pool.check_integrity()
    pool.free(b)  # then 3, 2
    assert _counts(pool) == (1, 0, 4)
    assert pool.num_available == 5

    assert pool.take_hits([_h("a0")]) == [0]  # revived, then freed again: now the most recent
    pool.check_integrity()
    pool.free([0])
    assert _counts(pool) == (1, 0, 4)  # cached order: 1, 3, 2, 0

    assert pool.allocate(1) == [4]  # free blocks go before any cached one
    assert pool.num_evicted == 0
    assert pool.allocate(1) == [1]  # a's tail
    assert _counts(pool) == (0, 2, 3)
    assert pool.num_evicted == 1
    assert pool.count_hits([_h("a0"), _h("a1")]) == 1  # its head is still there
    assert pool.allocate(2) == [3, 2]  # b's tail, then b's head
    assert _counts(pool) == (0, 4, 1)
    assert pool.count_hits([_h("b0")]) == 0
    assert pool.num_evicted == 3
    assert pool.allocate(1) == [0]
    assert _counts(pool) == (0, 5, 0)
    assert pool.count_hits([_h("a0")]) == 0
    pool.free([4, 1, 3, 2, 0])  # evicted blocks come back unnamed: free, not cached
    assert _counts(pool) == (5, 0, 0)


def test_register_keeps_the_first_block_of_a_hash() -> None:
    pool = _pool(3)
    assert pool.allocate(3) == [0, 1, 2]
    pool.register(0, _h("same"))
    pool.check_integrity()
    pool.register(1, _h("same"))  # another sequence computed the same block: block 0 keeps the name
    pool.check_integrity()
    pool.register(0, _h("other"))  # a named block keeps its first name too
    pool.check_integrity()
    assert pool.take_hits([_h("same")]) == [0]
    assert pool.count_hits([_h("other")]) == 0
    pool.free([1])
    assert _counts(pool) == (1, 2, 0)  # unnamed block 1 is plainly free
    pool.free([0, 2])
    assert _counts(pool) == (2, 1, 0)  # block 0 still has the take_hits reference
    pool.free([0])
    assert _counts(pool) == (2, 0, 1)
    with pytest.raises(AssertionError, match="not in use"):
        pool.register(1, _h("late"))


def test_pool_exhausted_takes_nothing() -> None:
    pool = _pool(3)
    assert pool.allocate(2) == [0, 1]
    with pytest.raises(PoolExhausted, match="2 blocks asked for, 1 of 3 available"):
        pool.allocate(2)
    assert _counts(pool) == (1, 2, 0)
    pool.register(0, _h("c"))
    pool.free([0])
    assert _counts(pool) == (1, 1, 1)
    with pytest.raises(PoolExhausted):
        pool.allocate(3)
    assert _counts(pool) == (1, 1, 1)
    assert pool.allocate(2) == [2, 0]  # the cached block counts as available
    assert _counts(pool) == (0, 3, 0)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_a_pool_that_keeps_few_cached_blocks_evicts_before_it_touches_fresh_ones() -> None:
    """keep_cached=2: a freed block is taken again before a fresh one; at two cached blocks, the oldest cached
    one is evicted rather than a fresh block touched; the pool still grows for blocks in use."""
    pool = BlockPool(8, keep_cached=2)
    a, b = pool.allocate(2)
    pool.register(a, _h("a"))
    pool.free([a, b])  # b free, a cached
    assert pool.allocate(1) == [b] and pool.num_touched == 2
    assert pool.allocate(1) == [2]  # fewer than two cached: a fresh one
    c = pool.allocate(1)[0]
    pool.register(c, _h("c"))
    pool.free([c])  # two cached now
    assert pool.allocate(1) == [a] and pool.num_evicted == 1  # the oldest cached, not a fresh block
    assert pool.allocate(5) == [4, 5, 6, 7, c] and pool.num_touched == 8
    pool.check_integrity()


def test_check_integrity_fails_on_a_broken_pool() -> None:
    pool = _pool(3)
    pool.free(pool.allocate(2)[1:])
    state = pool.state()
    assert state.free == (1,)
    check_pool_state(state)
    broken = dataclasses.replace(state, free=(1, 1))  # block 1 on the free list twice: no public operation can do this
    with pytest.raises(AssertionError, match="free list twice"):
        check_pool_state(broken)


# ---- the scheduler over a tiny pool --------------------------------------------------------


class _Source:
    """A KVSource the scheduler only needs to see; loads and saves are driven by hand here."""

    def load(self, seq: Sequence, first_block: int, blocks: list[int], cache: KVCache) -> int:
        return 0

    def save(self, seq: Sequence, first_block: int, kv: abc.Sequence[torch.Tensor], num_tokens: int) -> None:
        pass


def _seq(num_tokens: int, start: int = 0, *, max_new_tokens: int = 16, cached: bool = False,
         source: bool = False, num_saved_blocks: int = 0) -> Sequence:
    return Sequence(
        list(range(start, start + num_tokens)), Sampler(SamplingParams()), max_new_tokens=max_new_tokens,
        hash_root=ROOT if cached else None, source=_Source() if source else None,
        num_saved_blocks=num_saved_blocks,
    )


def _scheduler(num_blocks: int, block_size: int = 4, *, budget: int = 64, max_seqs: int | None = None) -> Scheduler:
    return Scheduler(_pool(num_blocks), block_size, SchedulerConfig(budget, max_seqs or min(budget, 64)))


def _schedule(sched: Scheduler) -> Schedule:
    plan = sched.schedule()
    sched.pool.check_integrity()
    return plan


def _step(sched: Scheduler, plan: Schedule) -> None:
    """What a forward does to the scheduled sequences: compute their tokens, name their full blocks,
    and append a sampled token to each that reached its end."""
    bs = sched.block_size
    for seq, n in plan.scheduled:
        assert len(seq.block_table) * bs >= seq.num_computed_tokens + n, "a token without a slot"
        seq.num_computed_tokens += n
        if seq.hash_root is not None:
            full = seq.num_computed_tokens // bs
            hashes = seq.full_block_hashes(bs, full)
            for i in range(seq.num_registered_blocks, full):
                sched.pool.register(seq.block_table[i], hashes[i])
            seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(900 + len(seq.token_ids))
        sched.pool.check_integrity()


def _finish(sched: Scheduler, seq: Sequence) -> None:
    sched.finish(seq)
    assert seq.status is Status.FINISHED and seq.block_table == []
    sched.pool.check_integrity()


def test_token_budget_chunks_prompts_and_admits_in_order() -> None:
    sched = _scheduler(16, budget=8)
    a, b, c = _seq(6), _seq(10, 100), _seq(3, 200)
    for seq in (a, b, c):
        sched.add(seq)

    plan = _schedule(sched)
    assert plan.scheduled == [(a, 6), (b, 2)] and plan.num_tokens == 8
    assert plan.admitted == [a, b] and list(sched.waiting) == [c]  # the budget is spent: c waits
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3, 4])
    _step(sched, plan)

    plan = _schedule(sched)
    assert plan.scheduled == [(a, 1), (b, 7)] and plan.admitted == []
    _step(sched, plan)
    assert (len(a.token_ids), b.num_computed_tokens) == (8, 9)

    plan = _schedule(sched)
    assert plan.scheduled == [(a, 1), (b, 1), (c, 3)] and plan.admitted == [c]
    assert c.block_table == [5]
    _step(sched, plan)

    plan = _schedule(sched)  # a's ninth token needs a third block
    assert plan.scheduled == [(a, 1), (b, 1), (c, 1)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 6], [2, 3, 4], [5])
    assert sched.pool.num_used == 7


def test_decode_tokens_go_before_prompt_chunks_and_fill_the_budget_first() -> None:
    sched = _scheduler(16, budget=8)
    a, b = _seq(3, source=True), _seq(30, 100)
    sched.add(a)
    sched.add(b)

    plan = _schedule(sched)
    assert plan.to_load == [a] and plan.admitted == [a, b]  # a loads without spending the budget
    assert plan.scheduled == [(b, 8)]
    assert a.status is Status.LOADING and len(sched.loading) == 1
    _step(sched, plan)
    sched.loaded(a, 2)  # its source had two tokens; the last is always computed
    sched.pool.check_integrity()
    assert sched.running == [b, a] and not sched.loading

    plan = _schedule(sched)  # a, admitted later, decodes first
    assert plan.scheduled == [(a, 1), (b, 7)]
    _step(sched, plan)

    sched.config = SchedulerConfig(max_num_batched_tokens=1, max_num_seqs=1)
    plan = _schedule(sched)  # only one token fits: the decode
    assert plan.scheduled == [(a, 1)]


def test_admission_waits_for_blocks_and_keeps_its_order() -> None:
    sched = _scheduler(6)
    a, b, c = _seq(12), _seq(12, 100), _seq(1, 200)
    for seq in (a, b, c):
        sched.add(seq)

    plan = _schedule(sched)
    # b needs 3 blocks; 3 are left but one is kept as headroom for running a. c fits, but queues behind b.
    assert plan.admitted == [a] and list(sched.waiting) == [b, c]
    assert a.block_table == [0, 1, 2]
    _step(sched, plan)

    _finish(sched, a)
    plan = _schedule(sched)
    assert plan.admitted == [b, c] and plan.scheduled == [(b, 12), (c, 1)]
    assert (b.block_table, c.block_table) == ([3, 4, 5], [2])


def test_max_num_seqs_caps_running_and_loading() -> None:
    sched = _scheduler(16, max_seqs=2)
    a, b, c = _seq(4, source=True), _seq(4, 100), _seq(4, 200)
    for seq in (a, b, c):
        sched.add(seq)
    plan = _schedule(sched)
    assert plan.admitted == [a, b] and list(sched.waiting) == [c]
    _finish(sched, a)  # a loading sequence leaves
    assert not sched.loading
    plan = _schedule(sched)
    assert plan.admitted == [c]


def _three_decoding(*, cached: bool) -> tuple[Scheduler, Sequence, Sequence, Sequence]:
    """a, b, c decoding in a pool of 5, b and c each in two blocks and none free, a about to need its second."""
    sched = _scheduler(5)
    a, b, c = _seq(1), _seq(2, 100), _seq(2, 200, cached=cached)
    for seq in (a, b, c):
        sched.add(seq)
    plan = _schedule(sched)
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    _step(sched, plan)
    for _ in range(3):  # b and c reach their fifth token first and take the last two blocks
        plan = _schedule(sched)
        assert plan.num_preempted == 0
        _step(sched, plan)
    assert (b.block_table, c.block_table, sched.pool.num_free) == ([1, 3], [2, 4], 0)
    assert (a.num_computed_tokens, c.num_computed_tokens) == (4, 5)
    return sched, a, b, c


def test_preemption_takes_the_newest_running_sequence_and_frees_its_blocks() -> None:
    sched, a, b, c = _three_decoding(cached=False)
    plan = _schedule(sched)  # a needs a block: c, the newest, goes; a gets c's last block
    assert plan.num_preempted == 1 and plan.spills == []
    assert plan.scheduled == [(a, 1), (b, 1)]
    assert (a.block_table, b.block_table) == ([0, 4], [1, 3])
    assert c.status is Status.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.stats.num_preemptions == 1 and list(sched.waiting) == [c] and sched.running == [a, b]
    assert (sched.pool.num_free, sched.pool.num_used, sched.pool.num_cached) == (1, 4, 0)


def test_a_preempted_sequence_comes_back_through_its_cached_blocks() -> None:
    sched, a, b, c = _three_decoding(cached=True)  # c's first block is named
    plan = _schedule(sched)
    assert plan.num_preempted == 1 and plan.scheduled == [(a, 1), (b, 1)]
    assert a.block_table == [0, 4]  # c's unnamed tail went to a; its named head stays cached
    assert (sched.pool.num_free, sched.pool.num_used, sched.pool.num_cached) == (0, 4, 1)
    assert list(sched.waiting) == [c]
    _step(sched, plan)

    _finish(sched, a)
    _finish(sched, b)
    plan = _schedule(sched)
    assert plan.admitted == [c] and plan.scheduled == [(c, 2)]
    assert c.block_table == [2, 4] and c.num_computed_tokens == 4 and c.stats.num_pool_hit_tokens == 4
    assert (sched.pool.num_free, sched.pool.num_used, sched.pool.num_cached) == (3, 2, 0)


def test_a_decoding_sequence_with_no_one_newer_preempts_itself() -> None:
    sched = _scheduler(3)
    a, b = _seq(4), _seq(4, 100)
    sched.add(a)
    sched.add(b)
    plan = _schedule(sched)
    assert plan.scheduled == [(a, 4), (b, 4)] and (a.block_table, b.block_table) == ([0], [1])
    _step(sched, plan)
    plan = _schedule(sched)  # a takes block 2; b finds none and nothing newer to take it from
    assert plan.scheduled == [(a, 1)] and plan.num_preempted == 1
    assert (a.block_table, b.status, list(sched.waiting)) == ([0, 2], Status.WAITING, [b])


def test_spill_names_the_blocks_past_those_the_source_has() -> None:
    sched = _scheduler(8)
    a = _seq(14, source=True, num_saved_blocks=1)
    sched.add(a)
    plan = _schedule(sched)
    assert plan.to_load == [a] and plan.scheduled == [] and a.block_table == [0, 1, 2, 3]
    sched.loaded(a, 4)
    plan = _schedule(sched)
    assert plan.scheduled == [(a, 10)]
    _step(sched, plan)

    assert sched.spill(a, a.num_computed_tokens) == Spill(a, 1, [1, 2, 3], 10)  # on finishing: the tail too
    assert sched.spill(a, 4) is None  # the source has block 0 already

    out = Schedule()
    sched.preempt(a, out)  # on preemption: full blocks only
    sched.pool.check_integrity()
    assert out.spills == [Spill(a, 1, [1, 2], 8)] and out.num_preempted == 1
    assert a.saving and sched.pool.num_used == 0 and list(sched.waiting) == [a]

    assert _schedule(sched).admitted == []  # not admitted again until its save lands
    a.saving = False
    plan = _schedule(sched)
    assert plan.admitted == [a] and plan.to_load == [a] and a.block_table == [4, 5, 6, 7]

    b = _seq(8)
    assert sched.spill(b, 8) is None  # no source, nothing to save


def test_no_block_is_leaked_by_cancellations_failures_and_preemptions() -> None:
    bs = 2
    sched = _scheduler(9, bs, budget=6, max_seqs=4)
    seqs = [  # a shared 6-token prefix; even ones share blocks through the pool, every third has a source
        Sequence([0, 1, 2, 3, 4, 5] + [100 + i] * (i % 3 + 1), Sampler(SamplingParams()),
                 max_new_tokens=4 + i % 4, hash_root=ROOT if i % 2 == 0 else None,
                 source=_Source() if i % 3 == 0 else None)
        for i in range(10)
    ]
    for seq in seqs:
        sched.add(seq)
    log: list[tuple[int, str, int]] = []  # (step, what, index in seqs)
    saving: list[Sequence] = []
    num_preempted = step = 0
    while sched.has_work:
        step += 1
        assert step < 200, "the scheduler made no progress"
        for seq in saving:  # last step's saves landed
            seq.saving = False
        if step == 3:  # two clients go away: one still queued, one running
            for seq in (sched.waiting[-1], sched.running[0]):
                log.append((step, f"cancel {seq.status.value}", seqs.index(seq)))
                _finish(sched, seq)
        plan = _schedule(sched)
        num_preempted += plan.num_preempted
        saving = [spill.seq for spill in plan.spills]
        for seq in plan.to_load:
            if seq is seqs[3]:  # cancelled while its source loads
                log.append((step, "cancel loading", 3))
                _finish(sched, seq)
            else:
                sched.loaded(seq, min(bs, len(seq.token_ids) - 1 - seq.num_computed_tokens))
                sched.pool.check_integrity()
        _step(sched, plan)
        if step == 4:  # the forward failed for one sequence
            log.append((step, "fail", seqs.index(plan.scheduled[0][0])))
            _finish(sched, plan.scheduled[0][0])
        for seq, _ in plan.scheduled:
            if seq.status is Status.RUNNING and seq.num_new_tokens >= seq.max_new_tokens:
                _finish(sched, seq)
                log.append((step, "done", seqs.index(seq)))
    assert log == [
        (3, "cancel waiting", 9), (3, "cancel running", 1), (4, "fail", 0), (10, "done", 2),
        (11, "cancel loading", 3), (14, "done", 4), (20, "done", 5), (28, "done", 7), (33, "done", 6),
        (37, "done", 8),
    ]
    assert num_preempted == 1  # 6, by 7's growth; its spill went to its source
    assert all(s.status is Status.FINISHED and s.block_table == [] for s in seqs)
    assert not sched.loading and not sched.running and not sched.waiting
    assert (sched.pool.num_free, sched.pool.num_used, sched.pool.num_cached) == (0, 0, 9)
    sched.pool.check_integrity()


def test_a_token_budget_below_the_sequence_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="must be at least max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=64)


def test_while_streams_decode_a_long_prompt_is_capped_and_one_that_fits_a_step_is_not() -> None:
    sched = Scheduler(_pool(64), 4, SchedulerConfig(16, 8, long_prompt_chunk=4))
    stream = _seq(2)
    sched.add(stream)
    _step(sched, _schedule(sched))  # its prompt, then it decodes
    turn, document = _seq(10, 100), _seq(40, 200)  # a chat turn fits a step of 16; the document does not
    sched.add(turn)
    sched.add(document)
    plan = _schedule(sched)
    assert plan.scheduled == [(stream, 1), (turn, 10), (document, 4)]
    _step(sched, plan)
    assert _schedule(sched).scheduled == [(stream, 1), (turn, 1), (document, 4)]  # the turn decodes too now
    sched.finish(turn)
    for _ in range(7):  # 4 + 7 * 4 = 32 of its 40: the 8 left would fit a step, and still go 4 a step
        _step(sched, _schedule(sched))
    assert document.num_computed_tokens == 32
    assert _schedule(sched).scheduled == [(stream, 1), (document, 4)]
    sched.finish(stream)
    plan = _schedule(sched)  # no stream left decoding: the document takes the budget
    assert plan.scheduled == [(document, 8)]


def test_a_prompt_is_long_by_what_it_has_left_when_its_first_tokens_are_scheduled() -> None:
    """A prompt waiting for blocks another is computing is judged once it gets tokens: the shared part then
    comes from the pool, and what is left may fit a step. A preempted one is judged again."""
    sched = Scheduler(_pool(64), 4, SchedulerConfig(16, 8, long_prompt_chunk=4))
    stream = _seq(2)
    sched.add(stream)
    _step(sched, _schedule(sched))
    first = _seq(48, 1000, cached=True)
    second = _seq(40, 1000, cached=True)
    second.token_ids += list(range(5000, 5008))  # the same 40 tokens, then 8 of its own
    sched.add(first)
    sched.add(second)
    for _ in range(10):  # first computes the 40 shared tokens 4 a step; second waits for them
        plan = _schedule(sched)
        assert (first, 4) in plan.scheduled and all(s is not second for s, _ in plan.scheduled)
        _step(sched, plan)
    assert first.long_prompt is True and second.long_prompt is None
    plan = _schedule(sched)  # second takes the 40 from the pool; its 8 fit a step
    assert (second, 8) in plan.scheduled and second.long_prompt is False
    out = Schedule()
    sched.preempt(first, out)
    assert first.long_prompt is None


def test_the_changes_a_router_is_told_are_where_each_hash_ended() -> None:
    """A hash evicted and named again between two looks is held (and one named, then evicted, is not): the
    pool's events must not tell a router the opposite of what the pool holds."""
    from decode_service.replica import PoolEvents

    pool, events = BlockPool(2), PoolEvents()
    pool.record_changes = True
    a, b = pool.allocate(2)
    pool.register(a, _h("1"))
    pool.register(b, _h("2"))
    pool.free([a])
    pool.free([b])  # cached after a: a goes first
    events.changed(*pool.take_changes())
    [c] = pool.allocate(1)  # evicts _h("1"), the oldest cached
    pool.register(c, _h("1"))  # the same prompt's block computed again, in the same step
    [d] = pool.allocate(1)  # evicts _h("2")
    pool.register(d, _h("3"))
    pool.free([d])
    [e] = pool.allocate(1)  # evicts _h("3"), named since the last look
    named, evicted = pool.take_changes()
    assert (named, evicted) == ([_h("1")], [_h("2"), _h("3")])  # h3's eviction tells a router nothing it holds
    events.changed(named, evicted)
    snapshot = events.subscribe().get_nowait()  # a new stream starts from what the events hold
    assert snapshot is not None and list(snapshot.hashes) == [_h("1")] and pool.count_hits([_h("1")]) == 1
    pool.free([c, e])
