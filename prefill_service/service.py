"""Prefill: compute only the part of a prompt whose KV the store does not have, and leave all of it
in the store for decode (docs/DESIGN.md, "Request flow", steps 1-5)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace

from kvserve.engine.engine import Engine
from kvserve.engine.hashing import Namespace, prefix_hashes
from kvserve.engine.model import max_new_tokens
from kvserve.engine.sampling import Sampler
from kvserve.engine.sequence import Finished, Sequence, TokenEvent
from kvserve.handoff.prefill_kv import PrefillKV, request_scoped_keys
from kvserve.handoff.requests import (
    PrefillHandle,
    PrefillTimings,
    PromptInput,
    RequestOptions,
    bounded_stored_blocks,
    encode,
)
from kvserve.handoff.session import StoreSession
from kvserve.rpc.admission import Admission, Ticket
from kvserve.rpc.errors import Cancelled, DeadlineExceeded, ServiceError, Unavailable
from kvserve.rpc.metrics import count_outcome, outcome_of
from kvstore import KVStoreClient
from prefill_service.metrics import PrefillMetrics
from protos.block_hash import BlockHash

DEFAULT_LEASE_TTL_S = 30.0
# Prompts waiting for their first token, and their tokens (--max-waiting-seqs, --max-waiting-tokens).
DEFAULT_MAX_WAITING_SEQS = 64
DEFAULT_MAX_WAITING_TOKENS = 65536
LIVENESS_POLL_S = 0.05  # how often a waiting request checks that its caller is still there


def _never() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class PrefillJob:
    request_id: str
    prompt: PromptInput
    options: RequestOptions
    deadline: float | None = None  # time.monotonic() after which the caller has given up
    cancelled: Callable[[], bool] = field(default=_never)  # true once the caller has gone away
    # The prompt's leading full blocks that the caller's own lookup found in the store, leased by the caller
    # (PrefillRequest.num_stored_blocks); None: it sent none, and prefill looks them up itself.
    num_stored_blocks: int | None = None

    def check_live(self, stage: str) -> None:
        """Raises when nobody waits for the answer any more, so that no forward pass is spent on it."""
        if self.cancelled():
            raise Cancelled(f"the caller cancelled the request {stage}")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"the caller's deadline passed {stage}")


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """Where a prompt's KV lives in the store: ``blocks`` key its full blocks (request-scoped with the prefix cache
    off), ``tail`` its partial last one; ``reusable``: the leading keys that may come from the store."""

    namespace: Namespace
    blocks: list[BlockHash]
    tail: BlockHash
    reusable: list[BlockHash]


class PrefillService:
    """Domain logic of the Prefill RPC over the batched Engine and the KV store: concurrent prompts
    share forward passes under the engine's token budget."""

    def __init__(
        self, engine: Engine, store: KVStoreClient, metrics: PrefillMetrics, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        admission: Admission | None = None,
    ) -> None:
        """`admission` bounds the prompts waiting for their first token (rpc.admission): past it a request is
        RESOURCE_EXHAUSTED at once, and decode computes that prompt itself."""
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.lease_ttl_s = lease_ttl_s
        self.admission = admission or Admission("prefill", DEFAULT_MAX_WAITING_SEQS, DEFAULT_MAX_WAITING_TOKENS)
        engine.on_step = metrics.engine.observe
        metrics.engine.show_attention(engine.runner.attention)  # what this engine runs (its device, its dtype)

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def _store_failed(self, op: str) -> None:
        self.metrics.store_failures.labels(op=op).inc()

    def refused(self, error: BaseException) -> None:
        """Counts a request refused as it arrived (busy), before it reached `prefill_stream`."""
        self.metrics.requests.labels(outcome=outcome_of(error)).inc()

    def prefill(self, job: PrefillJob) -> PrefillHandle:
        """The prompt's handle, once its KV is in the store."""
        *_, handle = self.prefill_stream(job)
        return handle

    def prefill_stream(self, job: PrefillJob) -> Iterator[PrefillHandle]:
        """An early handle (``kv_pending``) as soon as the first token is sampled, then the handle once
        the prompt's KV is in the store."""
        with count_outcome(self.metrics.requests):
            yield from self._prefill(job)

    def _prefill(self, job: PrefillJob) -> Iterator[PrefillHandle]:
        start = time.perf_counter()
        engine = self.engine
        token_ids = encode(engine.model, job.prompt)
        max_new_tokens(engine.model, len(token_ids), job.options.max_tokens)  # refuse what decode could not finish
        time_left = None if job.deadline is None else job.deadline - time.monotonic()
        ticket = self.admission.admit(len(token_ids), time_left)
        try:
            yield from self._admitted(job, token_ids, ticket, start)
        finally:
            ticket.release()

    def _admitted(self, job: PrefillJob, token_ids: list[int], ticket: Ticket, start: float
                  ) -> Iterator[PrefillHandle]:
        opts = job.options
        self.metrics.waiting.inc()
        try:
            # 1-2: hash full blocks; what the store holds of those that may be reused (never the last prompt token).
            keys = self._keys(job, token_ids)
            store = StoreSession(self.store, self._store_failed)
            if job.num_stored_blocks is None:  # no caller's lookup to go by: this request's one lookup
                num_hits, lookup_lease = store.lookup(keys.reusable, self.lease_ttl_s)
            else:  # the caller's lookup found them, and its lease pins them
                num_hits, lookup_lease = bounded_stored_blocks(job.num_stored_blocks, len(keys.reusable)), ""
        finally:
            self.metrics.waiting.dec()
        # For decode, a lease on what it will fetch, kept from eviction until decode has read it
        # (tests/test_e2e_store_faults.py, the flood between prefill and decode): each put leases its blocks, new
        # or stored before, under this request's lookup's lease (which pins its hits) or, after a caller's lookup
        # (whose lease pins those), under the lease the first put takes.
        store.lease_puts(self.lease_ttl_s, lookup_lease)
        kv = PrefillKV(store, keys.namespace, keys.blocks, keys.tail, ephemeral=not opts.prefix_cache)
        try:
            t_lookup = time.perf_counter()
            handle, t_first = yield from self._compute(job, token_ids, kv, num_hits, ticket)
            if job.num_stored_blocks is None:  # the puts' lease pins the hits too if this request's lookup leased them
                lease = self._decode_lease(store, keys.blocks, hits_leased=bool(lookup_lease) or not num_hits)
            else:
                lease = self._decode_lease(store, keys.blocks[num_hits:], hits_leased=True)
        finally:
            store.release(store.take_put_lease()[0])  # "" once handed on
        done = time.perf_counter()
        compute_s = max(0.0, t_first - t_lookup - kv.fetch_s)
        self._count(kv, handle, t_first - start, compute_s)
        yield replace(
            handle, block_hashes=tuple(keys.blocks), tail_key=keys.tail if kv.tail_stored else None, lease_id=lease,
            timings=PrefillTimings(lookup_s=t_lookup - start, fetch_s=kv.fetch_s, compute_s=compute_s,
                                   put_s=kv.put_s, total_s=done - start),
            kv_pending=False,
        )

    def _decode_lease(self, store: StoreSession, leased: list[BlockHash], hits_leased: bool) -> str:
        """The puts' lease, now decode's. Where the store left some put without a lease (past its caps), or the
        hits went unleased, a Lookup of ``leased`` instead: every block without a caller's lookup, else those past
        its hits."""
        lease, whole = store.take_put_lease()
        if whole and hits_leased:
            return lease
        _, looked_up = store.lookup(leased, self.lease_ttl_s)
        store.release(lease)
        return looked_up

    def _keys(self, job: PrefillJob, token_ids: list[int]) -> PromptKeys:
        engine, opts, bs = self.engine, job.options, self.engine.block_size
        namespace = engine.namespace(opts.cache_salt)
        if opts.prefix_cache:
            blocks = list(prefix_hashes(token_ids, bs, namespace.root()))
            tail = request_scoped_keys(namespace.root(), job.request_id, 0)[1]
            return PromptKeys(namespace, blocks, tail, blocks[: (len(token_ids) - 1) // bs])
        blocks, tail = request_scoped_keys(namespace.root(), job.request_id, len(token_ids) // bs)
        return PromptKeys(namespace, blocks, tail, [])

    def _compute(self, job: PrefillJob, token_ids: list[int], kv: PrefillKV, num_hits: int, ticket: Ticket
                 ) -> Generator[PrefillHandle, None, tuple[PrefillHandle, float]]:
        """3-5: the engine takes the pool's and the store's leading blocks, computes the rest in chunks beside
        other requests, samples the first token (its early handle yielded at once), and saves what it computed.
        Returns the early handle and when its token was sampled, once the prompt's KV is saved."""
        engine, opts = self.engine, job.options
        seq = Sequence(
            token_ids, Sampler(opts.sampling, engine.model.device), max_new_tokens=1,
            hash_root=kv.namespace.root() if opts.prefix_cache else None, source=kv, num_saved_blocks=num_hits,
            request_id=job.request_id,
        )
        job.check_live("before the prefill started")
        engine.add(seq)
        self.metrics.running.inc()
        try:
            first_token, t_first = self._first_token(seq, job)
            ticket.computed()
            num_cached = seq.stats.num_pool_hit_tokens + seq.stats.num_loaded_tokens
            handle = PrefillHandle(
                request_id=job.request_id, prompt_token_ids=tuple(token_ids), block_size=engine.block_size,
                block_hashes=(), tail_key=None, num_cached_tokens=num_cached,
                num_computed_tokens=len(token_ids) - num_cached, first_token_id=first_token, timings=PrefillTimings(),
                model_fingerprint=engine.model.fingerprint, kv_pending=True,
            )
            yield handle
            self._wait_saved(seq, job)
        finally:
            self.metrics.running.dec()
        return handle, t_first

    def _count(self, kv: PrefillKV, handle: PrefillHandle, ttft_s: float, compute_s: float) -> None:
        m = self.metrics
        if kv.error is not None:
            m.bad_blocks.labels(kind=kv.error.kind).inc()
        m.prompt_tokens.inc(len(handle.prompt_token_ids))
        m.cached_tokens.inc(handle.num_cached_tokens)
        m.computed_tokens.inc(handle.num_computed_tokens)
        m.generated_tokens.inc()
        m.stored_blocks.inc(kv.num_stored - kv.tail_stored)
        m.ttft.observe(ttft_s)
        m.compute.observe(compute_s)

    def _first_token(self, seq: Sequence, job: PrefillJob) -> tuple[int, float]:
        """The first token and when it was sampled."""
        event = self._next_event(seq, job)
        if isinstance(event, TokenEvent):
            return event.token_id, time.perf_counter()
        if event.reason == "shutdown":
            raise Unavailable("the prefill service is shutting down")
        raise ServiceError(f"the prefill failed: {event.error or event.reason}")

    def _wait_saved(self, seq: Sequence, job: PrefillJob) -> None:
        """Until the sequence has left the engine, its KV saved."""
        while not isinstance(self._next_event(seq, job), Finished):
            pass

    def _next_event(self, seq: Sequence, job: PrefillJob) -> TokenEvent | Finished:
        """The sequence's next event. When the caller goes away meanwhile, the sequence is aborted (the
        engine frees it at its next step) and this raises at once."""
        while True:
            try:
                return seq.events.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                try:
                    job.check_live("while its prompt was being computed")
                except (Cancelled, DeadlineExceeded):
                    self.engine.abort(seq)
                    raise

