"""The serving engine: the step loop and the inbox of request threads, over its parts (docs/DESIGN.md,
"Engine"): the KV cache (engine.kv_cache) and its block pool (engine.block_pool), the scheduler, the
model runner (one packed forward per step for every sequence it runs) and the KV connector (loads and
saves on a small pool of I/O threads, never on the step thread).

Request threads call ``add`` and ``abort`` (thread-safe; they land in an inbox) and read each
sequence's events. One thread runs ``step`` in a loop (``run``, or ``start`` for a thread of its
own; ``stop`` ends it), or a test calls ``step``/``run_until_done`` itself.

A sequence's KV goes to its source (the KV store) when it leaves the engine (finished, aborted with a
save, or preempted), and, if it is in the prefix cache (``hash_root``), each block as soon as it fills,
a step's new blocks of a sequence in one save: a stream that another replica continues finds them in
the store.

On a CPU, only the step thread runs tensor kernels on several cores; the I/O threads run theirs on
one. With OpenMP (torch's CPU backend), every thread that runs a parallel kernel keeps a team of
worker threads, and once a process holds more such threads than it has cores, OpenMP stops
spin-waiting between kernels: each of a step's few hundred small kernels then pays a wake-up, and a
step took 40 % longer. So a service runs ``run`` on its main thread, the one that loaded the model.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.hashing import Namespace
from kvserve.engine.kv_cache import KVCache, kv_cache_blocks
from kvserve.engine.kv_connector import KVConnector
from kvserve.engine.model import Model
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.sampling import Sampler, SamplingParams
from kvserve.engine.scheduler import Schedule, Scheduler, SchedulerConfig
from kvserve.engine.sequence import Finished, Sequence, Status, TokenEvent
from kvserve.host.cores import CoreShare
from protos.block_hash import BlockHash

log = logging.getLogger(__name__)

# The longest an idle engine sleeps between two looks at its state. Never unbounded: the loop runs on the
# main thread, the only one where Python runs a signal's handler, and a SIGTERM the kernel hands to another
# thread (gRPC's, OpenMP's) wakes no wait there; an idle decode or prefill ignored such a stop for good.
_IDLE_WAKE_S = 0.2
# warm_up: a prompt of this many tokens, then decode steps of 1 and WARM_UP_ROWS rows
WARM_UP_TOKENS = 64
WARM_UP_ROWS = 4


class RequestTooLarge(ValueError):
    """A sequence that could never fit the KV pool, even alone."""

    grpc_status = "RESOURCE_EXHAUSTED"  # read by the servers' error interceptor


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did, for metrics."""

    num_seqs: int  # in the forward
    num_tokens: int  # in the forward
    num_prompt_tokens: int  # of those, prompt tokens (the prompts' KV computed by this step)
    num_admitted: int
    num_preempted: int
    num_running: int  # sequences admitted (running or loading their KV) after the step
    num_waiting: int  # sequences waiting for admission after the step
    queue_wait_s: tuple[float, ...]  # of the sequences admitted in this step
    num_pool_hit_tokens: int  # prompt tokens taken from the pool: by the admitted sequences, and by coalescing
    num_coalesced_tokens: int  # prompt tokens taken from the pool once another running sequence computed them
    pool_used: int
    pool_free: int
    pool_cached: int
    num_threads: int = 0  # the threads the forward computed on (kvserve.host.cores: its own and those lent); 0: none
    forward_s: float = 0.0  # the forward's wall time
    # of it, the step thread off its core (the wall time less the thread's CPU time): waiting for a core that other
    # threads held (the streams' handlers, other processes) or for the GIL
    off_core_s: float = 0.0

    @property
    def idle(self) -> bool:
        return not self.num_seqs and not self.num_admitted


class Engine:
    def __init__(
        self,
        model: Model,
        block_size: int = 16,
        *,
        kv_cache_memory: int | None = None,
        config: SchedulerConfig | None = None,
        on_step: Callable[[StepStats], None] | None = None,
        io_threads: int = 4,
        on_pool_change: Callable[[list[BlockHash], list[BlockHash]], None] | None = None,
        cores: CoreShare | None = None,
        keep_cached: int | None = None,
        kv_cache_cap: int | None = None,
        head_copy: bool = True,
        release_after_idle_s: float | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        """`keep_cached`: the pool's engine.block_pool policy (None: it fills before it evicts; N: it grows past
        what its sequences use for at most N cached blocks, so its memory follows their peak). `kv_cache_cap`:
        most bytes the default pool takes on CPU (engine.kv_cache.default_kv_cache_memory). `head_copy`: an output
        embedding tied to the input one is packed as a copy of its own where packing leaves the table unreadable
        to the embedding (oneDNN's layout; engine.llama: a step of a few rows reads it in half the time, for the
        table's bytes once more): for an engine that samples every step (decode). The C kernel's panels hold the
        table once for both (engine.packed_linear).
        `release_after_idle_s`: once nothing has run for that long after some work, a pool in host memory forgets
        its cached blocks and gives their pages back (BlockPool.release, KVCache.release), then `on_release` runs
        on the step thread (a service trims its heap); None: never."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.on_step = on_step
        self.cores = cores  # the host's cores this engine shares with other services' (kvserve.host.cores)
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        config = config or SchedulerConfig()
        self.kv_cache = KVCache(
            kv_cache_blocks(model, block_size, kv_cache_memory, config.max_num_seqs, kv_cache_cap),
            num_layers=model.num_layers,
            block_size=block_size, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype=model.dtype,
            device=model.device,
        )
        self.pool = BlockPool(self.kv_cache.num_blocks, keep_cached)
        log.info("KV pool: %d blocks of %d tokens in %s (%d MiB, %d tokens)%s", self.kv_cache.num_blocks, block_size,
                 model.kv_dtype_name,
                 self.kv_cache.kv.nbytes >> 20, self.kv_cache.num_blocks * block_size,
                 "; its memory is taken as its blocks are used" if keep_cached is not None else "")
        # (hashes the pool named, hashes it evicted) after each step that changed them, on the step thread
        self.on_pool_change = on_pool_change
        self.pool.record_changes = on_pool_change is not None
        self.scheduler = Scheduler(self.pool, block_size, config)
        self.runner = ModelRunner(model, self.kv_cache, head_copy)
        self.connector = KVConnector(self.pool, self.kv_cache, functools.partial(self._post, internal=True),
                                     io_threads)
        self.release_after_idle_s = release_after_idle_s
        self.on_release = on_release
        self._worked_at: float | None = None  # time.monotonic() of the last step with work since the last release
        self._stopping = False
        self._running = threading.Event()  # run() has started
        self._stopped = threading.Event()  # run() has returned

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The namespace whose root seeds the prefix hashes of this model, dtype and block size."""
        return Namespace(self.model.fingerprint, self.model.kv_dtype_name, self.block_size, cache_salt)

    # ---- request threads -------------------------------------------------------------------

    def pool_hits(self, hashes: list[BlockHash]) -> int:
        """How many of the leading ``hashes`` the KV pool holds now. From another thread this is an estimate:
        the step thread may evict them, or name more, before a sequence asks for them."""
        return self.pool.count_hits(hashes)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; its events follow on ``seq.events``. RequestTooLarge if it could never fit."""
        if not seq.token_ids:
            raise ValueError("cannot run an empty sequence")
        need = self.scheduler.blocks_needed(len(seq.token_ids) + seq.max_new_tokens)
        if need > self.pool.num_blocks:
            raise RequestTooLarge(
                f"{len(seq.token_ids)} tokens + {seq.max_new_tokens} to generate need {need} KV blocks of "
                f"{self.block_size} tokens; the KV pool holds {self.pool.num_blocks} "
                "(raise --kv-cache-memory, or send a shorter request)"
            )
        self._post(lambda: self.scheduler.add(seq))

    def abort(self, seq: Sequence, save: bool = False) -> None:
        """Stop ``seq`` (a client went away, or a stop string ended it); with ``save`` its KV is saved
        first. Its Finished event follows."""
        self._post(lambda: self._abort(seq, save))

    def _post(self, fn: Callable[[], None], *, internal: bool = False) -> None:
        """Queue ``fn`` for the step thread. Requests are refused once stopping (RuntimeError); what the
        engine's own I/O threads post then is dropped: shutdown finishes every sequence itself."""
        with self._cond:
            if self._stopping:
                if internal:
                    return
                raise RuntimeError("the engine has stopped")
            self._inbox.append(fn)
            self._cond.notify()

    # ---- the step thread --------------------------------------------------------------------

    def start(self) -> None:
        """Runs ``run`` on a thread of its own (tests and in-process use; a service runs it on its main thread)."""
        self._running.set()
        threading.Thread(target=self.run, name="engine-step", daemon=True).start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends ``run`` (on whichever thread it runs) and waits up to ``timeout_s`` for it to have finished
        every sequence left."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._running.is_set():
            self._stopped.wait(timeout_s)
        self.connector.shutdown()

    def run(self) -> None:
        """Steps until ``stop``, sleeping while there is nothing to do; then fails what is left with
        "shutdown"."""
        self._running.set()
        try:
            self._run_loop()
        finally:
            self._stopped.set()

    def _run_loop(self) -> None:
        while True:
            with self._cond:
                if self.cores and not self._inbox and not self.scheduler.running:
                    self.cores.idle()
                while (not self._stopping and not self._inbox and not self.scheduler.running
                       and not self._release_due()):
                    self._cond.wait(_IDLE_WAKE_S)
                if self._stopping:
                    break
                release = not self._inbox and not self.scheduler.running and self._release_due()
            try:
                if release:
                    self._release()
                    continue
                stats = self.step()
                if not stats.idle and self.release_after_idle_s is not None:
                    self._worked_at = time.monotonic()
                if stats.idle and not self._inbox:
                    if self.cores:
                        self.cores.idle()
                    with self._cond:  # nothing could run: wait for a load, a save, an add or an abort
                        self._cond.wait(0.05)
            except Exception as exc:  # a bug, not one request's failure: fail what was running, go on
                log.exception("engine step failed; failing its %d running sequences", len(self.scheduler.running))
                for seq in list(self.scheduler.running):
                    self._finish(seq, "error", error=f"internal engine error: {type(exc).__name__}: {exc}",
                                 save=False)
        self._drain()
        for seq in [*self.scheduler.running, *self.scheduler.loading, *self.scheduler.waiting]:
            self.scheduler.finish(seq)
            seq.events.put(Finished("shutdown", "the engine is shutting down"))
        self.connector.release_all()

    def _release_due(self) -> bool:
        if self._worked_at is None or self.release_after_idle_s is None:
            return False
        return (not self.scheduler.has_work and not self.connector.num_in_flight
                and time.monotonic() - self._worked_at >= self.release_after_idle_s)

    def _release(self) -> None:
        """What an idle engine gives back (`release_after_idle_s`). The pool's pages and the heap are high-water
        marks: after a burst of 200 prompts, an idle prefill on the tiny llama held 312 MiB of pool pages for
        the peak of its blocks in use, and glibc kept 226 MiB of freed buffers in its heap (under its trim
        threshold, kvserve.host.process.prepare_engine_process), round after round."""
        self._worked_at = None
        began = time.perf_counter()
        touched = self.pool.release() if self.kv_cache.releasable else 0
        self.kv_cache.release(touched)
        if self.on_pool_change is not None:
            named, evicted = self.pool.take_changes()
            if named or evicted:
                self.on_pool_change(named, evicted)
        if self.on_step is not None:  # the pool's gauges
            self.on_step(self._stats(Schedule(), 0))
        if self.on_release is not None:
            self.on_release()
        log.debug("idle: gave back %d KV blocks (%d MiB) in %.3f s", touched,
                  touched * self.kv_cache.block_bytes >> 20, time.perf_counter() - began)

    def warm_up(self, timeout_s: float = 120.0) -> float:
        """Run a prompt chunk and decode steps of one and several rows on private blocks, before the first
        request (a service calls it before it says SERVING): what a first step pays once (oneDNN's kernels for
        each shape, the C kernels' first build, pages of the pool and of the weights) is not a user's TTFT.
        Nothing is kept: the blocks are unhashed and freed. Seconds taken."""
        began = time.perf_counter()
        vocab = self.model.vocab_size
        room = max(1, min(WARM_UP_TOKENS, self.pool.num_blocks * self.block_size // (WARM_UP_ROWS + 1) - 2))
        for rows in (1, WARM_UP_ROWS):
            seqs = [Sequence([(7 * i + 3 * row) % vocab for i in range(room)],
                             Sampler(SamplingParams(), self.model.device), 2) for row in range(rows)]
            for seq in seqs:
                self.add(seq)
            self.run_until_done(timeout_s)
        return time.perf_counter() - began

    def run_until_done(self, timeout_s: float = 600.0) -> None:
        """Step until every added sequence has finished (tests and benchmarks, without ``start``)."""
        deadline = time.monotonic() + timeout_s
        while self._inbox or self.scheduler.has_work or self.connector.num_in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not finish its sequences in time")
            if self.step().idle and not self._inbox:
                with self._cond:
                    self._cond.wait(0.01)

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._inbox:
                    return
                fn = self._inbox.popleft()
            fn()

    def step(self) -> StepStats:
        """Admit, schedule and run one packed forward (none when nothing can run)."""
        self._drain()
        plan = self.scheduler.schedule()
        for spill in plan.spills:
            self.connector.save(spill)
        for seq in plan.to_load:
            self.connector.load(seq, self._loaded)
        threads, forward_s, off_core_s = 0, 0.0, 0.0
        if plan.scheduled:
            if self.cores:
                self.cores.busy()
            threads = self.cores.current if self.cores else torch.get_num_threads()
            began, cpu = time.perf_counter(), time.thread_time()
            try:
                self._run(plan.scheduled)
                forward_s = time.perf_counter() - began
                off_core_s = max(0.0, forward_s - (time.thread_time() - cpu))
            finally:
                if self.cores:
                    self.cores.step_done()
        stats = self._stats(plan, threads, forward_s, off_core_s)
        if self.on_pool_change is not None:
            named, evicted = self.pool.take_changes()
            if named or evicted:
                self.on_pool_change(named, evicted)
        if self.on_step is not None:
            self.on_step(stats)
        return stats

    def _stats(self, plan: Schedule, threads: int, forward_s: float = 0.0, off_core_s: float = 0.0) -> StepStats:
        now = time.perf_counter()
        return StepStats(
            num_seqs=len(plan.scheduled), num_tokens=plan.num_tokens, num_admitted=len(plan.admitted),
            num_preempted=plan.num_preempted, num_running=len(self.scheduler.running) + len(self.scheduler.loading),
            num_waiting=len(self.scheduler.waiting),
            queue_wait_s=tuple(now - s.stats.arrival for s in plan.admitted if not s.stats.num_preemptions),
            num_prompt_tokens=plan.num_prompt_tokens, num_pool_hit_tokens=plan.num_pool_hit_tokens,
            num_coalesced_tokens=plan.num_coalesced_tokens,
            pool_used=self.pool.num_used, pool_free=self.pool.num_free, pool_cached=self.pool.num_cached,
            num_threads=threads, forward_s=forward_s, off_core_s=off_core_s,
        )

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """One forward for the batch; if it fails, each sequence alone, so a failure fails only its own."""
        try:
            tokens = self.runner.run(scheduled)
        except Exception as exc:
            if len(scheduled) == 1:
                self._finish(scheduled[0][0], "error", error=f"{type(exc).__name__}: {exc}", save=False)
                return
            log.warning("a batched step of %d sequences failed (%s); retrying each alone", len(scheduled), exc)
            for item in scheduled:
                self._run([item])
            return
        for seq, n in scheduled:
            self._advance(seq, n, tokens.get(seq))

    def _advance(self, seq: Sequence, n: int, token: int | None) -> None:
        before = seq.num_computed_tokens
        seq.num_computed_tokens += n
        seq.stats.num_engine_computed_tokens += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - before)
        self.scheduler.register(seq)
        if token is None:
            self._save_filled(seq)
            return
        seq.token_ids.append(token)
        reason = None
        if token in seq.stop_token_ids:
            reason = "stop"
        elif seq.num_new_tokens >= seq.max_new_tokens:
            reason = "length"
        seq.events.put(TokenEvent(token, reason))
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._save_filled(seq)

    def _save_filled(self, seq: Sequence) -> None:
        """Save the blocks of a sequence in the prefix cache that filled since its last save, so that its KV
        is in the store before it finishes (a stream another replica continues finds it there). The
        scheduler has hashed them (``register``): the I/O thread only reads the sequence's hashes."""
        if seq.hash_root is None:
            return
        spill = self.scheduler.spill(seq, seq.num_computed_tokens // self.block_size * self.block_size)
        if spill is not None:
            self.connector.save(spill, ticket=self.connector.retain(spill))  # read in place: the blocks stay full

    def _finish(self, seq: Sequence, reason: str, error: str = "", save: bool = True) -> None:
        spill = self.scheduler.spill(seq, seq.num_computed_tokens) if save else None
        ticket = None if spill is None else self.connector.retain(spill)  # saved straight out of the KV cache
        self.scheduler.finish(seq)

        def finished() -> None:
            seq.events.put(Finished(reason, error))

        if spill is None:  # Finished still follows the saves of its filled blocks in flight
            self.connector.after_saves(seq, finished)
        else:
            self.connector.save(spill, finished, ticket=ticket)

    def _loaded(self, seq: Sequence, num_tokens: int) -> None:
        self.scheduler.loaded(seq, num_tokens)
        self.scheduler.register(seq)
        if seq.aborting is not None:
            self._finish(seq, "aborted", save=seq.aborting == "save")

    def _abort(self, seq: Sequence, save: bool) -> None:
        if seq.status is Status.LOADING:
            seq.aborting = "save" if save else "drop"
        elif seq.status is not Status.FINISHED:
            self._finish(seq, "aborted", save=save and seq.status is Status.RUNNING)
