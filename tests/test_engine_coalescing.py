"""In-flight prefix coalescing: sequences that share a prefix nobody has computed yet compute it once. One
computes it (its owner); the others wait, admitted, while it does, take its blocks from the pool by prefix
hash as they are registered, and compute only their own suffixes. Outputs stay the oracle's; waiting never
deadlocks, leaks a block or a claim, or holds back other sequences; when the owner leaves (cancelled,
preempted) a waiter computes the rest itself.

Every run ends with the pool intact, no block in use (``tests.engine_fixtures.finish``) and no claim left.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from kvserve.engine.engine import Engine, StepStats
from kvserve.engine.model import Model
from kvserve.engine.scheduler import Schedule
from kvserve.engine.sequence import Finished, Status
from kvserve.engine.sequence import Sequence as KVSequence
from tests.engine_fixtures import (
    ARCHS,
    DictStore,
    Outcome,
    PrefixSource,
    assert_matches_oracle,
    finish,
    make_engine,
    make_seq,
    random_tokens,
    run,
    tiny_model,
)

BLOCK = 8
PREFIX = 64  # 8 full blocks
SUFFIX = 5
MAX_NEW = 8


class Totals:
    """An ``on_step`` callback that adds up what the steps did."""

    def __init__(self) -> None:
        self.prompt_tokens = self.coalesced_tokens = self.pool_hit_tokens = self.preempted = 0

    def __call__(self, stats: StepStats) -> None:
        self.prompt_tokens += stats.num_prompt_tokens
        self.coalesced_tokens += stats.num_coalesced_tokens
        self.pool_hit_tokens += stats.num_pool_hit_tokens
        self.preempted += stats.num_preempted


def _prompts(n: int, seed: int, prefix: Sequence[int] | None = None, suffix: int = SUFFIX) -> list[list[int]]:
    """``n`` prompts: one shared prefix (``PREFIX`` random tokens unless given), each with its own suffix."""
    shared = list(prefix) if prefix is not None else random_tokens(PREFIX, seed=seed)
    return [shared + random_tokens(suffix, seed=seed * 100 + i + 1) for i in range(n)]


def _finish(engine: Engine, seqs: Sequence[KVSequence]) -> list[Outcome]:
    outcomes = finish(engine, seqs)
    assert not engine.scheduler.in_flight, "a claim outlived its sequence"
    return outcomes


def _start_with_waiters_loading(engine: Engine, owner: KVSequence, waiters: list[KVSequence],
                                source: PrefixSource) -> None:
    """Admit ``waiters`` first, loading their KV from ``source`` (an empty store: they find nothing, spending no
    budget), then ``owner``, which computes its first chunk; step until the waiters run, waiting behind it."""
    for seq in [*waiters, owner]:
        engine.add(seq)
    engine.step()
    assert owner.status is Status.RUNNING and all(w.status is Status.LOADING for w in waiters)
    deadline = time.monotonic() + 30
    while len(source.loads) < len(waiters):  # each load posts its result right after recording it
        assert time.monotonic() < deadline, "the loads did not finish"
        time.sleep(0.001)
    while engine.scheduler.loading:
        engine.step()
    assert all(w.stats.num_loaded_tokens == 0 and w.stats.num_engine_computed_tokens == 0 for w in waiters)


@pytest.mark.parametrize("arrival", ["together", "loading"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_fresh_shared_prefix_is_computed_once(arch: str, arrival: str) -> None:
    """8 prompts of 64 shared tokens (8 blocks) and 5 of their own. "together": all admitted in one step; the
    first computes its whole prompt while the other 7 wait, then each computes its 5 tokens. "loading": the 7
    are admitted loading (nothing found) while the first computes the prefix a block per step; they take its
    blocks as it registers them. Either way the engine computes 64 + 8 x 5 prompt tokens, not 8 x 69, and
    every output is the cold run's and the oracle's."""
    model = tiny_model(arch)
    totals = Totals()
    budget = 256 if arrival == "together" else BLOCK
    engine = make_engine(model, BLOCK, 256, max_num_batched_tokens=budget, max_num_seqs=8, on_step=totals)
    root = engine.namespace().root()
    prompts = _prompts(8, seed=1)
    if arrival == "together":
        seqs = [make_seq(model, p, MAX_NEW, hash_root=root) for p in prompts]
        for seq in seqs:
            engine.add(seq)
        engine.step()
        assert [s.stats.num_engine_computed_tokens for s in seqs] == [PREFIX + SUFFIX] + [0] * 7
        assert all(s.status is Status.RUNNING for s in seqs)  # admitted, waiting
    else:
        source = PrefixSource(DictStore(), engine.namespace())
        seqs = [make_seq(model, prompts[0], MAX_NEW, hash_root=root),
                *(make_seq(model, p, MAX_NEW, hash_root=root, source=source) for p in prompts[1:])]
        _start_with_waiters_loading(engine, seqs[0], seqs[1:], source)
        assert 0 < seqs[0].num_computed_tokens < PREFIX  # the waiters came while the prefix was computed
    outcomes = _finish(engine, seqs)

    assert [s.stats.num_engine_computed_tokens for s in seqs] == [PREFIX + SUFFIX] + [SUFFIX] * 7
    assert [s.stats.num_coalesced_tokens for s in seqs] == [0] + [PREFIX] * 7
    assert [s.stats.num_pool_hit_tokens for s in seqs] == [0] + [PREFIX] * 7
    assert (totals.prompt_tokens, totals.coalesced_tokens, totals.pool_hit_tokens) == (
        PREFIX + 8 * SUFFIX, 7 * PREFIX, 7 * PREFIX)
    cold = run(make_engine(model, BLOCK, 256), [make_seq(model, p, MAX_NEW) for p in prompts])  # nothing shared
    assert [o.tokens for o in outcomes] == [o.tokens for o in cold]
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_sixteen_users_of_one_system_prompt_compute_it_once() -> None:
    """The prefill service's case: 16 requests of one fresh 2,048-token system prompt and a 64-token question
    each, arriving together, missing the store: 2,048 + 16 x 64 = 3,072 prompt tokens computed, not 33,792."""
    model = tiny_model("llama")
    totals = Totals()
    engine = make_engine(model, 16, 16 * 140, on_step=totals)
    source = PrefixSource(DictStore(), engine.namespace())
    root = engine.namespace().root()
    seqs = [make_seq(model, p, 2, hash_root=root, source=source)
            for p in _prompts(16, seed=2, prefix=random_tokens(2048, seed=2), suffix=64)]
    outcomes = run(engine, seqs)
    assert not engine.scheduler.in_flight
    assert (totals.prompt_tokens, totals.coalesced_tokens) == (2048 + 16 * 64, 15 * 2048)
    assert sorted(s.stats.num_engine_computed_tokens for s in seqs) == [64] * 15 + [2048 + 64]
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def _owner_and_waiters(model: Model, engine: Engine, seed: int) -> tuple[KVSequence, list[KVSequence], PrefixSource]:
    """An owner a few blocks into its 64-token prefix (a block per step) and two sequences waiting for it."""
    root = engine.namespace().root()
    source = PrefixSource(DictStore(), engine.namespace())
    owner, *waiters = (make_seq(model, p, MAX_NEW, hash_root=root, source=source if i else None)
                       for i, p in enumerate(_prompts(3, seed=seed)))
    _start_with_waiters_loading(engine, owner, waiters, source)
    for _ in range(2):
        engine.step()
    assert 2 * BLOCK <= owner.num_computed_tokens < PREFIX
    assert all(w.status is Status.RUNNING and w.stats.num_engine_computed_tokens == 0 for w in waiters)
    assert all(0 < w.stats.num_coalesced_tokens < owner.num_computed_tokens for w in waiters)
    assert set(engine.scheduler.in_flight.values()) == {owner}
    return owner, waiters, source


def _assert_waiters_took_over(waiters: list[KVSequence], owner_done: int) -> None:
    """One waiter computed the part of the prefix the owner had not (``owner_done`` tokens) and its suffix; the
    other only its suffix."""
    assert sorted(w.stats.num_engine_computed_tokens for w in waiters) == [SUFFIX, PREFIX - owner_done + SUFFIX]


def test_waiters_compute_the_prefix_themselves_when_its_owner_is_cancelled() -> None:
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 256, max_num_batched_tokens=BLOCK, max_num_seqs=BLOCK)
    owner, waiters, _ = _owner_and_waiters(model, engine, seed=3)
    done = owner.num_computed_tokens
    engine.abort(owner)
    cancelled, *outcomes = _finish(engine, [owner, *waiters])
    assert cancelled == Outcome([], Finished("aborted"))
    assert owner.stats.num_engine_computed_tokens == done
    _assert_waiters_took_over(waiters, done)
    for seq, outcome in zip(waiters, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_waiters_take_over_the_prefix_when_its_owner_is_preempted() -> None:
    """The scheduler preempts the owner mid-prefix (as it would for lack of blocks, had its waiters, newer, gone
    first): a waiter computes the rest; the owner, admitted again, takes its own blocks and the waiter's from the
    pool and computes its suffix."""
    model = tiny_model("llama")
    engine = make_engine(model, BLOCK, 256, max_num_batched_tokens=BLOCK, max_num_seqs=BLOCK)
    owner, waiters, _ = _owner_and_waiters(model, engine, seed=4)
    done = owner.num_computed_tokens
    out = Schedule()
    engine.scheduler.preempt(owner, out)
    assert out.num_preempted == 1 and not out.spills and owner.status is Status.WAITING
    assert not engine.scheduler.in_flight  # its claims went with it
    outcomes = _finish(engine, [owner, *waiters])
    assert owner.stats.num_preemptions == 1 and owner.stats.num_pool_hit_tokens + owner.stats.num_coalesced_tokens >= done
    _assert_waiters_took_over(waiters, done)
    assert owner.stats.num_engine_computed_tokens == done + SUFFIX  # no prefix token computed twice
    for seq, outcome in zip([owner, *waiters], outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


def test_different_prefixes_do_not_wait_on_each_other_and_waiters_leave_the_budget_to_others() -> None:
    """Two users of prefix P, two of prefix Q, and one of P in another namespace (its own cache salt), submitted
    together: in the first step each prefix's first user computes its whole prompt, beside the others; the second
    users wait, spending no budget, and then take their prefix from the pool."""
    model = tiny_model("llama")
    totals = Totals()
    engine = make_engine(model, BLOCK, 256, on_step=totals)
    root, salted = engine.namespace().root(), engine.namespace("tenant-b").root()
    p, q = _prompts(3, seed=5), _prompts(2, seed=6)
    seqs = [make_seq(model, p[0], MAX_NEW, hash_root=root), make_seq(model, p[1], MAX_NEW, hash_root=root),
            make_seq(model, q[0], MAX_NEW, hash_root=root), make_seq(model, q[1], MAX_NEW, hash_root=root),
            make_seq(model, p[2], MAX_NEW, hash_root=salted)]
    for seq in seqs:
        engine.add(seq)
    engine.step()
    full = PREFIX + SUFFIX
    assert [s.stats.num_engine_computed_tokens for s in seqs] == [full, 0, full, 0, full]
    outcomes = _finish(engine, seqs)
    assert [s.stats.num_engine_computed_tokens for s in seqs] == [full, SUFFIX, full, SUFFIX, full]
    assert [s.stats.num_coalesced_tokens for s in seqs] == [0, PREFIX, 0, PREFIX, 0]
    assert (totals.prompt_tokens, totals.coalesced_tokens) == (3 * full + 2 * SUFFIX, 2 * PREFIX)
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)


@pytest.mark.parametrize("resume_from", ["pool", "store"])
def test_sharing_a_prefix_in_a_small_pool_with_preemptions(resume_from: str) -> None:
    """8 users of one 32-token prefix (3 tokens of their own) arrive together and decode 24 tokens each in a
    pool of 24 blocks: the first 4 fit; one computes the prefix while 3 wait and take it, later ones find it at
    admission; decoding runs out of blocks, the newest are preempted and come back through the pool (or the
    store). The prefix is computed once, every output is the oracle's, and no claim or block is left over."""
    model = tiny_model("llama")
    totals = Totals()
    engine = make_engine(model, BLOCK, 24, max_num_batched_tokens=64, max_num_seqs=16, on_step=totals)
    root = engine.namespace().root()
    source = PrefixSource(DictStore(), engine.namespace()) if resume_from == "store" else None
    seqs = [make_seq(model, p, 24, hash_root=root, source=source)
            for p in _prompts(8, seed=7, prefix=random_tokens(32, seed=7), suffix=3)]
    for seq in seqs:
        engine.add(seq)
    outcomes = _finish(engine, seqs)
    assert totals.preempted > 0 and totals.coalesced_tokens == 3 * 32
    computed = sorted(s.stats.num_engine_computed_tokens for s in seqs)
    assert computed[-1] == 35 and computed[-2] <= 2 * 3  # others: their suffix, again after a preemption
    for seq, outcome in zip(seqs, outcomes, strict=True):
        assert_matches_oracle(model, seq, outcome)
