"""KV in and out of the engine: sequences' blocks loaded from their KVSource (the KV store) into the KV
cache, and saved back out of it, on a small pool of I/O threads, never on the step thread. What follows a
load or a save on the step thread is handed back through ``post``."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvserve.engine import native
from kvserve.engine.block_pool import BlockPool
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.scheduler import Spill
from kvserve.engine.sequence import Sequence

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


def _wait(previous: Future[None] | None) -> None:
    """Wait on an I/O thread for a save submitted before this work: the pool takes work in order, so that
    one has started already, and waiting cannot starve it of a thread."""
    if previous is not None:
        wait([previous])


class KVConnector:
    def __init__(self, pool: BlockPool, cache: KVCache, post: Callable[[Callable[[], None]], None],
                 io_threads: int = 4) -> None:
        self.pool = pool
        self.cache = cache
        self.block_size = cache.block_size
        self._post = post  # runs a function on the step thread
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-io", initializer=torch.set_num_threads,
                                     initargs=(1,))  # one core each: see engine.engine's docstring
        self.num_in_flight = 0  # loads and saves whose step-thread part has not run yet (step thread only)
        self._retained: dict[int, list[int]] = {}  # by ticket: blocks of finished sequences being saved
        self._tickets = itertools.count()
        if cache.kv.device.type == "cpu":
            native.copy_finite(cache.kv.dtype)  # built now (handoff.transfer's checking copy), not in a request's fetch

    @property
    def num_retained(self) -> int:
        """Blocks kept in use until the saves reading them are done."""
        return sum(len(blocks) for blocks in self._retained.values())

    def load(self, seq: Sequence, then: Callable[[Sequence, int], None]) -> None:
        """Fill ``seq``'s blocks past its computed tokens from its source; then, on the step thread,
        ``then(seq, num_tokens)`` with how many tokens landed (0 on any failure: they are computed)."""
        first = seq.num_computed_tokens // self.block_size

        def work() -> Callable[[], None]:
            try:
                assert seq.source is not None
                n = seq.source.load(seq, first, seq.block_table[first:], self.cache)
                n = max(0, min(n, len(seq.token_ids) - 1 - seq.num_computed_tokens))
            except Exception:
                log.exception("loading the KV of request %s failed: recomputing it", seq.request_id)
                n = 0
            return functools.partial(self._loaded, seq, first, n, then)

        self._submit(work)

    def _loaded(self, seq: Sequence, first_block: int, num_tokens: int, then: Callable[[Sequence, int], None]) -> None:
        # Blocks the source did not have are computed here, and saved there when the sequence leaves.
        seq.num_saved_blocks = min(seq.num_saved_blocks, first_block + num_tokens // self.block_size)
        then(seq, num_tokens)

    def retain(self, spill: Spill) -> int:
        """Keep ``spill``'s blocks in use (its sequence is about to free them) until the save given the ticket
        returned here has read them."""
        self.pool.retain(spill.blocks)
        ticket = next(self._tickets)
        self._retained[ticket] = spill.blocks
        return ticket

    def save(self, spill: Spill, then: Callable[[], None] = _nothing, *, ticket: int | None = None) -> None:
        """Save ``spill`` to its sequence's source; ``then`` runs on the I/O thread once it is done, or instead
        of it if the engine stops first. With a ``ticket`` from ``retain``, the source reads the cache's slots
        themselves, freed once it is done; without (a preempted sequence's blocks, which go to others at once)
        it reads a copy, and the sequence may be admitted again once it is done.

        A sequence's saves land in the order they were made, so the ``then`` of its last one follows them
        all. Its full blocks count as saved from now on, so none is saved twice; a save that fails gives
        them back to the next one."""
        blocks = spill.blocks
        kv = [self.cache.kv[b] for b in blocks] if ticket is not None else list(self.cache.kv[blocks])
        seq, source = spill.seq, spill.seq.source
        assert source is not None
        previous = seq.last_save
        seq.num_saved_blocks = spill.first_block + spill.num_tokens // self.block_size

        def work() -> Callable[[], None]:
            _wait(previous)
            saved = False
            try:
                source.save(seq, spill.first_block, kv, spill.num_tokens)
                saved = True
            except Exception:
                log.exception("saving the KV of request %s failed", seq.request_id)
            then()
            return functools.partial(self._saved, spill, ticket, saved)

        seq.last_save = self._submit(work, on_cancel=then)

    def after_saves(self, seq: Sequence, then: Callable[[], None]) -> None:
        """``then`` once the saves of ``seq`` in flight have landed: at once if none is, else on an I/O
        thread (or instead, if the engine stops first)."""
        previous = seq.last_save
        if previous is None or previous.done():
            then()
            return

        def work() -> Callable[[], None]:
            _wait(previous)
            then()
            return _nothing

        seq.last_save = self._submit(work, on_cancel=then)

    def _saved(self, spill: Spill, ticket: int | None, saved: bool) -> None:
        seq = spill.seq
        if not saved:
            seq.num_saved_blocks = min(seq.num_saved_blocks, spill.first_block)
        if ticket is None:
            seq.saving = False
        elif (blocks := self._retained.pop(ticket, None)) is not None:
            self.pool.free(blocks)

    def release_all(self) -> None:
        """Free every retained block: the engine has stopped, and no forward will write them again."""
        for blocks in self._retained.values():
            self.pool.free(blocks)
        self._retained.clear()

    def shutdown(self) -> None:
        """Start no more loads or saves; those not started run their ``on_cancel`` instead."""
        self.io.shutdown(wait=False, cancel_futures=True)

    def _submit(self, work: Callable[[], Callable[[], None]], on_cancel: Callable[[], None] | None = None
                ) -> Future[None]:
        """Run ``work`` on an I/O thread, then what it returns on the step thread; ``on_cancel`` instead if the
        engine stops before ``work`` starts."""
        self.num_in_flight += 1
        # `on_cancel` is dropped once `work` starts: the future keeps its callbacks, and one that still held it
        # (through it, the sequence, whose `last_save` is this future) would keep the sequence in a cycle.
        cancel = [on_cancel] if on_cancel is not None else []

        def run() -> None:
            cancel.clear()
            done = _nothing
            try:
                done = work()
            finally:
                self._post(functools.partial(self._done, done))

        future = self.io.submit(run)
        if cancel:
            future.add_done_callback(lambda f: cancel[0]() if cancel and f.cancelled() else None)
        return future

    def _done(self, then: Callable[[], None]) -> None:
        self.num_in_flight -= 1
        then()
