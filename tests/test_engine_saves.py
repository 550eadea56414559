"""A sequence in the prefix cache has its blocks saved to its source as they fill, not only when it leaves the
engine: each block once, in order, the save on leaving holding only the rest, and its Finished after the last
save. A sequence outside the prefix cache is saved when it leaves, as before."""

from __future__ import annotations

import gc
import weakref
from collections import abc

import pytest
import torch

from kvserve.engine.engine import Engine
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.sequence import Finished, Status
from kvserve.engine.sequence import Sequence as KVSequence
from tests.engine_fixtures import (
    DictStore,
    GatedSource,
    PrefixSource,
    finish,
    make_engine,
    make_seq,
    random_tokens,
    tiny_model,
)
from tests.polling import wait_until

BLOCK = 8


def _setup(source_class: type[PrefixSource] = PrefixSource) -> tuple[Engine, PrefixSource]:
    engine = make_engine(tiny_model("llama"), BLOCK, 32)
    return engine, source_class(DictStore(), engine.namespace())


def _keys(engine: Engine, seq: KVSequence, num_blocks: int) -> set[bytes]:
    return set(prefix_hashes(seq.token_ids[: num_blocks * BLOCK], BLOCK, engine.namespace().root()))


def test_filled_blocks_are_in_the_store_while_the_sequence_runs() -> None:
    engine, source = _setup()
    seq = make_seq(engine.model, random_tokens(2 * BLOCK + 3, seed=61), 5 * BLOCK, source=source,
                   hash_root=engine.namespace().root())
    engine.add(seq)
    while seq.num_computed_tokens < 4 * BLOCK:
        engine.step()
    wait_until(lambda: _keys(engine, seq, 4) <= set(source.store.blocks))  # 2 of the prompt, 2 generated
    assert seq.status is Status.RUNNING
    (outcome,) = finish(engine, [seq])
    assert outcome.finished == Finished("length")
    # 19 + 39 tokens with KV: the prompt's 2 blocks in its step, each generated block as it filled, then the
    # partial last one on leaving; none twice.
    assert [(s.first_block, s.num_tokens) for s in source.saves] == [
        (0, 2 * BLOCK), (2, BLOCK), (3, BLOCK), (4, BLOCK), (5, BLOCK), (6, BLOCK), (7, 2)]
    assert set(source.store.blocks) == _keys(engine, seq, 7)
    assert seq.num_saved_blocks == 7


def test_a_sequence_outside_the_prefix_cache_is_saved_when_it_leaves() -> None:
    engine, source = _setup()
    seq = make_seq(engine.model, random_tokens(2 * BLOCK + 3, seed=62), 3 * BLOCK, source=source)
    engine.add(seq)
    finish(engine, [seq])
    assert [(s.first_block, s.num_tokens) for s in source.saves] == [(0, 2 * BLOCK + 3 + 3 * BLOCK - 1)]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_saved_sequence_is_freed_as_soon_as_it_is_let_go(prefix_cache: bool) -> None:
    """Nothing the engine keeps of a sequence it saved refers back to it (a future's done-callback did, through
    the sequence's `last_save`): it is freed when its caller lets go, not at the next full collection, which
    the services hold off while calls come (kvserve.host.collector.collect_when_quiet)."""
    engine, source = _setup()
    seq = make_seq(engine.model, random_tokens(2 * BLOCK + 3, seed=65), 3 * BLOCK, source=source,
                   hash_root=engine.namespace().root() if prefix_cache else None)
    engine.add(seq)
    finish(engine, [seq])
    wait_until(lambda: engine.connector.num_in_flight == 0)
    assert seq.last_save is not None and source.saves
    gone = weakref.ref(seq.events)  # the sequence's own (a Sequence takes no weak reference)
    gc.disable()
    try:
        del seq  # the I/O thread may still hold its last work item a moment
        wait_until(lambda: gone() is None, timeout_s=5, message="the sequence is kept in a reference cycle")
    finally:
        gc.enable()


def test_finished_follows_the_saves_in_flight_even_with_nothing_left_to_save() -> None:
    engine, source = _setup(GatedSource)
    assert isinstance(source, GatedSource)
    seq = make_seq(engine.model, random_tokens(2 * BLOCK + 1, seed=63), 4 * BLOCK, source=source,
                   hash_root=engine.namespace().root())
    engine.add(seq)
    while seq.num_computed_tokens < 3 * BLOCK:
        engine.step()
    assert seq.num_computed_tokens == 3 * BLOCK and seq.num_saved_blocks == 3  # all of them on their way
    engine.abort(seq, save=True)
    for _ in range(5):
        engine.step()
    assert seq.status is Status.FINISHED
    assert engine.pool.num_used == 3  # held for the saves, which wait at the gate
    events = []
    while not seq.events.empty():
        events.append(seq.events.get())
    assert not any(isinstance(e, Finished) for e in events)
    source.gate.set()
    (outcome,) = finish(engine, [seq])
    assert outcome.finished == Finished("aborted")
    assert [(s.first_block, s.num_tokens) for s in source.saves] == [(0, 2 * BLOCK), (2, BLOCK)]


class FailingOnce(PrefixSource):
    """The first save fails."""

    def __init__(self, store: DictStore, namespace: Namespace) -> None:
        super().__init__(store, namespace)
        self.failed = False

    def save(self, seq: KVSequence, first_block: int, kv: abc.Sequence[torch.Tensor], num_tokens: int) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("the store fell over")
        super().save(seq, first_block, kv, num_tokens)


def test_blocks_whose_save_failed_go_with_the_next_save() -> None:
    engine, source = _setup(FailingOnce)
    seq = make_seq(engine.model, random_tokens(2 * BLOCK + 1, seed=64), 5 * BLOCK, source=source,
                   hash_root=engine.namespace().root())
    engine.add(seq)
    while seq.num_saved_blocks < 2:  # the prompt's blocks on their way
        engine.step()
    wait_until(lambda: seq.last_save is not None and seq.last_save.done())  # failed, before another block fills
    finish(engine, [seq])
    assert source.saves[0].first_block == 0  # the prompt's blocks, again
    assert set(source.store.blocks) == _keys(engine, seq, seq.num_computed_tokens // BLOCK)
