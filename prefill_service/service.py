"""Prefill: compute only the part of a prompt whose KV the store does not have, and leave all of it
in the store for decode (DESIGN.md, "Request flow", steps 1-5)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.hashing import prefix_hashes
from engine.kv_codec import encode_block
from engine.model import Model, encode_prompt, max_new_tokens
from engine.sampling import Sampler
from kvstore import KVStoreClient
from prefill_service.metrics import PrefillMetrics
from protos.block_hash import BlockHash
from serving.cache_session import StoreSession
from serving.errors import Cancelled, DeadlineExceeded, InvalidArgument
from serving.metrics import count_outcome
from serving.requests import PrefillHandle, PrefillTimings, PromptInput, RequestOptions

DEFAULT_LEASE_TTL_S = 30.0


def _never() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class PrefillJob:
    request_id: str
    prompt: PromptInput
    options: RequestOptions
    deadline: float | None = None  # time.monotonic() after which the caller has given up
    cancelled: Callable[[], bool] = field(default=_never)  # true once the caller has gone away

    def check_live(self, stage: str) -> None:
        """Raises when nobody waits for the answer any more, so that no forward pass is spent on it."""
        if self.cancelled():
            raise Cancelled(f"the caller cancelled the request {stage}")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"the caller's deadline passed {stage}")


def request_scoped_keys(root: BlockHash, request_id: str, num_blocks: int) -> tuple[list[BlockHash], BlockHash]:
    """Random 32-byte keys for one request's blocks and tail: no other request can name them."""
    base = hashlib.sha256(b"kvserve/request\x00" + root + os.urandom(16) + request_id.encode()).digest()
    blocks = [BlockHash(hashlib.sha256(base + b"block" + i.to_bytes(4, "little")).digest()) for i in range(num_blocks)]
    return blocks, BlockHash(hashlib.sha256(base + b"tail").digest())


def encode(model: Model, prompt: PromptInput) -> list[int]:
    """Token ids of the prompt; a bad prompt (token id outside the vocabulary...) is InvalidArgument."""
    messages = None
    if prompt.messages is not None:
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
    try:
        return encode_prompt(
            model,
            text=prompt.text,
            messages=messages,
            token_ids=list(prompt.token_ids) if prompt.token_ids is not None else None,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


class PrefillService:
    """Domain logic of the Prefill RPC over an Engine and the KV store; one forward pass at a time."""

    def __init__(
        self, engine: Engine, store: KVStoreClient, metrics: PrefillMetrics, lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    ) -> None:
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.lease_ttl_s = lease_ttl_s
        self._engine_lock = threading.Lock()

    @contextmanager
    def _engine_turn(self) -> Iterator[None]:
        self.metrics.waiting.inc()
        with self._engine_lock:
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            try:
                yield
            finally:
                self.metrics.running.dec()

    def _store_failed(self, op: str) -> None:
        self.metrics.store_failures.labels(op=op).inc()

    def prefill(self, job: PrefillJob) -> PrefillHandle:
        with count_outcome(self.metrics.requests):
            return self._prefill(job)

    def _prefill(self, job: PrefillJob) -> PrefillHandle:
        start = time.perf_counter()
        engine, opts, bs = self.engine, job.options, self.engine.block_size
        token_ids = encode(engine.model, job.prompt)
        max_new_tokens(engine.model, len(token_ids), opts.max_tokens)  # refuse what decode could not finish
        namespace = engine.namespace(opts.cache_salt)
        store = StoreSession(self.store, self._store_failed)

        # 1-2: hash full blocks; look up those that may be reused (never the last prompt token).
        if opts.prefix_cache:
            keys = list(prefix_hashes(token_ids, bs, namespace.root()))
            tail_key = request_scoped_keys(namespace.root(), job.request_id, 0)[1]
            reusable = keys[: (len(token_ids) - 1) // bs]
        else:
            keys, tail_key = request_scoped_keys(namespace.root(), job.request_id, len(token_ids) // bs)
            reusable = []
        num_hits, lookup_lease = store.lookup(reusable, self.lease_ttl_s)
        try:
            t_lookup = time.perf_counter()

            # 3: fetch the leading hits.
            cached = engine.load_leading(store.get(reusable[:num_hits]), namespace)
            if cached.error is not None:
                self.metrics.bad_blocks.labels(kind=cached.error.kind).inc()
            t_fetch = time.perf_counter()

            # 4: compute the rest and sample the first token, unless the caller has gone meanwhile.
            with self._engine_turn():
                job.check_live("before the prefill started")
                t_compute0 = time.perf_counter()
                result = engine.prefill(token_ids, cached.blocks)
                first_token = Sampler(opts.sampling).sample(result.logits)
                new_blocks = [encode_block(kv, namespace) for kv in result.new_blocks]
                tail = encode_block(result.tail, namespace) if result.tail is not None else None
                engine.release(result.sequence)
            t_compute = time.perf_counter()
            ttft = t_compute - start

            # 5: put the new full blocks and the tail; lease every prompt block for decode.
            stored = store.put(zip(keys[len(cached.blocks):], new_blocks, strict=True),
                               ephemeral=not opts.prefix_cache)
            if tail is not None:
                store.put([(tail_key, tail)], ephemeral=True)
            _, lease = store.lookup(keys, self.lease_ttl_s)
        finally:
            store.release(lookup_lease)
        done = time.perf_counter()

        m = self.metrics
        m.prompt_tokens.inc(len(token_ids))
        m.cached_tokens.inc(result.num_cached_tokens)
        m.computed_tokens.inc(result.num_computed_tokens)
        m.generated_tokens.inc()
        m.stored_blocks.inc(stored)
        m.ttft.observe(ttft)
        m.compute.observe(t_compute - t_compute0)
        return PrefillHandle(
            request_id=job.request_id,
            prompt_token_ids=tuple(token_ids),
            block_size=bs,
            block_hashes=tuple(keys),
            tail_key=None if tail is None else tail_key,
            num_cached_tokens=result.num_cached_tokens,
            num_computed_tokens=result.num_computed_tokens,
            first_token_id=first_token,
            timings=PrefillTimings(
                lookup_s=t_lookup - start, fetch_s=t_fetch - t_lookup, compute_s=t_compute - t_fetch,
                put_s=done - t_compute, total_s=done - start,
            ),
            lease_id=lease,
            model_fingerprint=engine.model.fingerprint,
        )
