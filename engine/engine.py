"""The serving engine: a paged KV pool, a scheduler, and one packed forward per step for every
sequence it runs (docs/DESIGN.md, "Engine").

Request threads call ``add`` and ``abort`` (thread-safe; they land in an inbox) and read each
sequence's events. One thread runs ``step`` in a loop (``run``, or ``start`` for a thread of its
own; ``stop`` ends it), or a test calls ``step``/``run_until_done`` itself. KV sources load and save
on a small pool of I/O threads, never on the step thread.

On a CPU, only the step thread runs tensor kernels on several cores; the I/O threads run theirs on
one. With OpenMP (torch's CPU backend), every thread that runs a parallel kernel keeps a team of
worker threads, and once a process holds more such threads than it has cores, OpenMP stops
spin-waiting between kernels: each of a step's few hundred small kernels then pays a wake-up, and a
step took 40 % longer. So a service runs ``run`` on its main thread, the one that loaded the model.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.hashing import Namespace
from engine.kv_pool import KVPool
from engine.model import Model
from engine.paged_attention import PagedCache, PromptChunk, StepBatch, chunk_mask, install
from engine.sampling import sample_batch
from engine.scheduler import Schedule, Scheduler, SchedulerConfig, Spill
from engine.sequence import Finished, Sequence, Status, TokenEvent

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB on CPU, when --kv-cache-memory is not given
DEFAULT_CUDA_KV_CACHE_FRACTION = 0.5  # of the device memory free once the model is loaded


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

    @property
    def idle(self) -> bool:
        return not self.num_seqs and not self.num_admitted


@dataclass(slots=True)
class _Forward:
    """The inputs of one packed forward and which rows of its logits are sampled."""

    batch: StepBatch
    input_ids: torch.Tensor  # [1, tokens]
    positions: torch.Tensor  # [1, tokens]
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)


def kv_pool_blocks(model: Model, block_size: int, kv_cache_memory: int | None) -> int:
    """Blocks that fit ``kv_cache_memory`` bytes (default: 1 GiB on CPU, half the free memory on CUDA)."""
    per_block = KVPool.bytes_per_block(
        num_layers=model.num_layers, block_size=block_size, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=model.dtype,
    )
    if kv_cache_memory is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            kv_cache_memory = int(free * DEFAULT_CUDA_KV_CACHE_FRACTION)
        else:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_BYTES
    blocks = kv_cache_memory // per_block
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {kv_cache_memory} bytes holds no block of {per_block} bytes")
    return blocks


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
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.pool = KVPool(
            kv_pool_blocks(model, block_size, kv_cache_memory), num_layers=model.num_layers,
            block_size=block_size, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype=model.dtype,
            device=model.device,
        )
        self.scheduler = Scheduler(self.pool, config or SchedulerConfig())
        self.on_step = on_step
        install(model.hf_model)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.hf_model.forward).parameters
        # A ready 4D mask makes the model skip building one; paged_attention does its own masking.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=model.device)
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-io", initializer=torch.set_num_threads,
                                      initargs=(1,))  # one core each: see the module's docstring
        self._io_in_flight = 0  # loads and saves submitted and not yet done
        self._retained: dict[int, list[int]] = {}  # blocks of finished sequences being saved (step thread only)
        self._stopping = False
        self._running = threading.Event()  # run() has started
        self._stopped = threading.Event()  # run() has returned

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The namespace whose root seeds the prefix hashes of this model, dtype and block size."""
        return Namespace(self.model.fingerprint, self.model.kv_dtype_name, self.block_size, cache_salt)

    # ---- request threads -------------------------------------------------------------------

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
        self._io.shutdown(wait=False, cancel_futures=True)

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
                while not self._stopping and not self._inbox and not self.scheduler.running:
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                if self.step().idle and not self._inbox:
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
        for blocks in self._retained.values():  # saves still reading them get no more forwards
            self.pool.free(blocks)
        self._retained.clear()

    def run_until_done(self, timeout_s: float = 600.0) -> None:
        """Step until every added sequence has finished (tests and benchmarks, without ``start``)."""
        deadline = time.monotonic() + timeout_s
        while self._inbox or self.scheduler.has_work or self._io_in_flight:
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
            self._save(spill, lambda seq: self._post(lambda: self._saved(seq), internal=True))
        for seq in plan.to_load:
            self._submit_io(functools.partial(self._load, seq))
        if plan.scheduled:
            self._run(plan.scheduled)
        stats = self._stats(plan)
        if self.on_step is not None:
            self.on_step(stats)
        return stats

    def _stats(self, plan: Schedule) -> StepStats:
        now = time.perf_counter()
        return StepStats(
            num_seqs=len(plan.scheduled), num_tokens=plan.num_tokens, num_admitted=len(plan.admitted),
            num_preempted=plan.num_preempted, num_running=len(self.scheduler.running) + len(self.scheduler.loading),
            num_waiting=len(self.scheduler.waiting),
            queue_wait_s=tuple(now - s.arrival for s in plan.admitted if not s.num_preemptions),
            num_prompt_tokens=plan.num_prompt_tokens, num_pool_hit_tokens=plan.num_pool_hit_tokens,
            num_coalesced_tokens=plan.num_coalesced_tokens,
            pool_used=self.pool.num_used, pool_free=self.pool.num_free, pool_cached=self.pool.num_cached,
        )

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """One forward for the batch; if it fails, each sequence alone, so a failure fails only its own."""
        try:
            tokens = self._forward_and_sample(scheduled)
        except Exception as exc:
            if len(scheduled) == 1:
                self._finish(scheduled[0][0], "error", error=f"{type(exc).__name__}: {exc}", save=False)
                return
            log.warning("a batched step of %d sequences failed (%s); retrying each alone", len(scheduled), exc)
            for item in scheduled:
                self._run([item])
            return
        for seq, n in scheduled:
            self._advance(seq, n, tokens.get(id(seq)))

    @torch.inference_mode()
    def _forward_and_sample(self, scheduled: list[tuple[Sequence, int]]) -> dict[int, int]:
        fwd = self._prepare(scheduled)
        m = self.model
        rows = torch.tensor(fwd.logit_rows, dtype=torch.long, device=m.device)
        kwargs = {"logits_to_keep": rows} if self._logits_to_keep else {}
        out = m.hf_model(
            input_ids=fwd.input_ids, position_ids=fwd.positions, attention_mask=self._no_mask, use_cache=True,
            kvserve_step=fwd.batch, **{m.cache_keyword: PagedCache(fwd.batch)}, **kwargs,
        )
        logits = out.logits[0] if self._logits_to_keep else out.logits[0, rows]  # [sampled, vocab]
        if not fwd.sampled:
            return {}
        tokens = sample_batch(logits, [s.sampler for s in fwd.sampled])
        for seq, row in zip(fwd.sampled, logits, strict=True):
            if seq.keep_logits:
                seq.logits = row.float()
        return {id(seq): token for seq, token in zip(fwd.sampled, tokens, strict=True)}

    def _prepare(self, scheduled: list[tuple[Sequence, int]]) -> _Forward:
        bs, device = self.block_size, self.model.device
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        chunks: list[PromptChunk] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in scheduled:
            start, end, row = seq.num_computed_tokens, seq.num_computed_tokens + n, len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table[: -(-end // bs)]
            slot_blocks.extend(table[p // bs] for p in range(start, end))
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                chunks.append(PromptChunk(row, n, end, torch.tensor(table, device=device),
                                          chunk_mask(start, end, device)))
            if end == len(seq.token_ids):
                logit_rows.append(row + n - 1)
                sampled.append(seq)
        pos = torch.tensor(positions, device=device)
        decode = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=device)
            lens = torch.tensor(decode_lens, device=device)
            mask = (torch.arange(width * bs, device=device)[None, :] < lens[:, None])[:, None, None, :]
            decode = (torch.tensor(decode_rows, device=device), tables, mask)
        batch = StepBatch(
            pool=self.pool,
            slot_blocks=torch.tensor(slot_blocks, device=device),
            slot_offsets=pos % bs,
            decode_rows=decode[0] if decode else None,
            decode_tables=decode[1] if decode else None,
            decode_mask=decode[2] if decode else None,
            chunks=tuple(chunks),
        )
        return _Forward(batch, torch.tensor([ids], device=device), pos[None], logit_rows, sampled)

    def _advance(self, seq: Sequence, n: int, token: int | None) -> None:
        before = seq.num_computed_tokens
        seq.num_computed_tokens += n
        seq.num_engine_computed_tokens += max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - before)
        self.scheduler.register(seq)
        if token is None:
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

    def _finish(self, seq: Sequence, reason: str, error: str = "", save: bool = True) -> None:
        spill = self.scheduler.spill(seq, seq.num_computed_tokens) if save else None
        if spill is not None:  # saved straight out of the pool: its blocks stay in use until then
            self.pool.retain(spill.blocks)
            self._retained[id(spill)] = spill.blocks
        self.scheduler.finish(seq)
        if spill is None:
            seq.events.put(Finished(reason, error))
        else:
            self._save(spill, lambda s: s.events.put(Finished(reason, error)), retained=True)

    def _save(self, spill: Spill, then: Callable[[Sequence], None], *, retained: bool = False) -> None:
        # A preempted sequence's blocks go to others at once, so a copy of them is saved; a finished
        # one's stay in use (retained) until the save has read the pool's slots themselves.
        kv = [self.pool.kv[b] for b in spill.blocks] if retained else list(self.pool.kv[spill.blocks])
        source = spill.seq.source
        assert source is not None

        def done() -> None:
            if retained:
                self._post(lambda: self._release(spill), internal=True)
            then(spill.seq)

        def save() -> None:
            try:
                source.save(spill.seq, spill.first_block, kv, spill.num_tokens)
                spill.seq.num_saved_blocks = spill.first_block + spill.num_tokens // self.block_size
            except Exception:
                log.exception("saving the KV of request %s failed", spill.seq.request_id)
            done()

        self._submit_io(save, on_cancel=done)

    def _release(self, spill: Spill) -> None:
        if self._retained.pop(id(spill), None) is not None:
            self.pool.free(spill.blocks)

    def _submit_io(self, fn: Callable[[], None], on_cancel: Callable[[], None] | None = None) -> None:
        """Run ``fn`` on an I/O thread; ``on_cancel`` instead if the engine stops before it starts."""
        with self._cond:
            self._io_in_flight += 1

        def run() -> None:
            try:
                fn()
            finally:
                with self._cond:
                    self._io_in_flight -= 1
                    self._cond.notify()

        future = self._io.submit(run)
        if on_cancel is not None:
            future.add_done_callback(lambda f: on_cancel() if f.cancelled() else None)

    def _saved(self, seq: Sequence) -> None:
        seq.saving = False

    def _load(self, seq: Sequence) -> None:
        first = seq.num_computed_tokens // self.block_size
        try:
            assert seq.source is not None
            n = seq.source.load(seq, first, seq.block_table[first:], self.pool)
            n = max(0, min(n, len(seq.token_ids) - 1 - seq.num_computed_tokens))
        except Exception:
            log.exception("loading the KV of request %s failed: recomputing it", seq.request_id)
            n = 0
        self._post(lambda: self._loaded(seq, first, n), internal=True)

    def _loaded(self, seq: Sequence, first_block: int, num_tokens: int) -> None:
        # Blocks the source did not have are computed here, and saved there when the sequence leaves.
        seq.num_saved_blocks = min(seq.num_saved_blocks, first_block + num_tokens // self.block_size)
        self.scheduler.loaded(seq, num_tokens)
        self.scheduler.register(seq)
        if seq.aborting is not None:
            self._finish(seq, "aborted", save=seq.aborting == "save")

    def _abort(self, seq: Sequence, save: bool) -> None:
        if seq.status is Status.LOADING:
            seq.aborting = "save" if save else "drop"
        elif seq.status is not Status.FINISHED:
            self._finish(seq, "aborted", save=save and seq.status is Status.RUNNING)
