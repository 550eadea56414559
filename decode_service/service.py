"""Generate: the front door's domain logic (docs/DESIGN.md, "Request flow", steps 6-8).

Prefill computes the prompt and samples the first token, which is sent at once; decode then
fetches the prompt's KV from the store (recomputing what is missing), generates in the shared
decode loop, and finally stores the KV blocks of the generated tokens so that the next turn of a
chat hits the cache on the reply as well as on the prompt.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from decode_service.cancellation import Cancellation
from decode_service.metrics import DecodeMetrics
from decode_service.stopping import Generation, TokenOutput
from engine.engine import Engine
from engine.model import max_new_tokens
from engine.sampling import Sampler, SamplingParams
from engine.sequence import Finished, Sequence
from handoff.decode_kv import DecodeKV
from handoff.requests import PrefillHandle, PromptInput, RequestOptions
from handoff.session import StoreSession
from kvstore import KVStoreClient
from prefill_service.client import PrefillCall, PrefillCancelled, PrefillReplicas
from rpc.errors import FailedPrecondition, ServiceError, Unavailable
from rpc.metrics import outcome_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerateJob:
    request_id: str
    prompt: PromptInput
    options: RequestOptions
    arrival: float  # time.perf_counter() when the request arrived
    time_left_s: float | None = None  # the client's deadline, if it set one


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Timings:
    ttft_s: float
    prefill_s: float
    decode_s: float
    total_s: float


@dataclass(frozen=True, slots=True)
class GenerateOutcome:
    finish_reason: str
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    usage: Usage
    timings: Timings


class DeploymentMismatch(FailedPrecondition):
    """Prefill and decode serve different models or block sizes: one deployment must agree."""


class RequestState:
    """How a request ended when it ends without an exception (e.g. cancelled)."""

    def __init__(self) -> None:
        self.outcome = "ok"
        self.in_engine = False  # past this, the request no longer counts as waiting
        self.result_sent = False  # past this, a client that hangs up has cancelled nothing


class DecodeService:
    def __init__(self, engine: Engine, store: KVStoreClient, prefill: PrefillReplicas, metrics: DecodeMetrics) -> None:
        self.engine = engine
        self.store = store
        self.prefill = prefill
        self.metrics = metrics
        self._stopping = False
        engine.on_step = metrics.engine.observe

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self._stopping = True
        self.engine.stop()
        self.prefill.close()

    def _store_failed(self, op: str) -> None:
        self.metrics.store_failures.labels(op=op).inc()

    def generate(self, job: GenerateJob, cancel: Cancellation) -> Iterator[TokenOutput | GenerateOutcome]:
        """Streams each token as it is sampled, then the outcome. Returns early, quietly, once
        `cancel` fires (the client went away): the work it caused stops."""
        m = self.metrics
        state = RequestState()
        m.waiting.inc()
        try:
            yield from self._generate(job, cancel, state)
        except BaseException as exc:
            if not (state.result_sent and isinstance(exc, GeneratorExit)):
                state.outcome = outcome_of(exc)
            raise
        finally:
            if not state.in_engine:
                m.waiting.dec()
            m.requests.labels(outcome=state.outcome).inc()

    def _generate(
        self, job: GenerateJob, cancel: Cancellation, state: RequestState
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        m, engine, opts = self.metrics, self.engine, job.options
        if self._stopping:
            raise Unavailable("the decode service is shutting down")
        try:
            call, handle = self._first_answer(job, cancel)
        except PrefillCancelled:
            state.outcome = "cancelled"
            return
        t_prefilled = time.perf_counter()
        self._check_same_deployment(handle, call.addr)
        prompt = handle.prompt_token_ids
        max_tokens = max_new_tokens(engine.model, len(prompt), opts.max_tokens)
        generation = Generation(
            engine.model.tokenizer, prompt, max_tokens, engine.model.eos_token_ids,
            stop=opts.stop, ignore_eos=opts.ignore_eos,
        )
        first = generation.accept(handle.first_token_id)
        t_first = time.perf_counter()
        m.ttft.observe(t_first - job.arrival)
        m.prompt_tokens.inc(len(prompt))
        m.cached_tokens.inc(handle.num_cached_tokens)
        m.computed_tokens.inc(handle.num_computed_tokens)
        yield first
        try:
            handle = self._kv_handle(call, handle)
        except PrefillCancelled:
            state.outcome = "cancelled"
            return

        namespace = engine.namespace(opts.cache_salt)
        kv = DecodeKV(StoreSession(self.store, self._store_failed), namespace, handle, opts.prefix_cache)
        try:
            if first.finish_reason is None:
                seq = Sequence(
                    [*prompt, first.token_id], self._sampler(opts.sampling), max_new_tokens=max_tokens - 1,
                    stop_token_ids=frozenset() if opts.ignore_eos else engine.model.eos_token_ids,
                    hash_root=namespace.root() if opts.prefix_cache else None, source=kv,
                    num_saved_blocks=len(prompt) // engine.block_size, request_id=job.request_id,
                )
                yield from self._decode(seq, generation, cancel, state, t_first)
                self._count_kv(seq, kv, handle.request_id)
        finally:
            kv.release_lease()
        if not generation.finished:
            return
        done = time.perf_counter()
        m.generated_tokens.inc(len(generation.token_ids))
        m.e2e.observe(done - job.arrival)
        state.result_sent = True
        yield GenerateOutcome(
            finish_reason=generation.finish_reason or "",
            text=generation.text,
            token_ids=tuple(generation.token_ids),
            prompt_token_ids=prompt,
            usage=Usage(len(prompt), handle.num_cached_tokens, len(generation.token_ids)),
            timings=Timings(
                ttft_s=t_first - job.arrival, prefill_s=t_prefilled - job.arrival, decode_s=done - t_first,
                total_s=done - job.arrival,
            ),
        )

    def _first_answer(self, job: GenerateJob, cancel: Cancellation) -> tuple[PrefillCall, PrefillHandle]:
        """The prefill call and its first answer. A prefill replica that is unavailable (restarting, its
        connection dropped) is marked down and another asked, or the same one once more when it is the
        only one: the call is idempotent, it only fills a cache."""
        tried: list[str] = []
        attempts = max(2, len(self.prefill.clients))
        for attempt in range(1, attempts + 1):
            call = self.prefill.start(job.request_id, job.prompt, job.options, time_left_s=job.time_left_s,
                                      avoid=tried)
            cancel.on_cancel(call.cancel)
            try:
                return call, call.first()
            except Unavailable as exc:
                if attempt == attempts:
                    raise
                self.prefill.mark_down(call.addr)
                tried.append(call.addr)
                log.warning("prefill at %s unavailable for %s (%s): asking again", call.addr, job.request_id, exc)
        raise AssertionError("unreachable")

    def _kv_handle(self, call: PrefillCall, early: PrefillHandle) -> PrefillHandle:
        """The handle naming the prompt's KV in the store, once prefill has stored it. If prefill fails now,
        after the first token went out, decode computes the prompt itself (the early handle names no KV)."""
        if not early.kv_pending:
            return early
        try:
            return call.result()
        except ServiceError as exc:
            log.warning("prefill failed after the first token of %s (%s): computing its prompt here",
                        early.request_id, exc)
            return early

    def _check_same_deployment(self, handle: PrefillHandle, prefill_addr: str) -> None:
        """The prompt's token ids and first token come from prefill's model, its blocks from its block
        size: with another model here every token would be wrong, with another block size no block
        would ever be reused. Refused before anything is streamed."""
        model, bs = self.engine.model, self.engine.block_size
        problems = []
        if handle.model_fingerprint != model.fingerprint:
            theirs = handle.model_fingerprint[:12] or "unknown (an older prefill service)"
            problems.append(f"model {theirs} there, {model.fingerprint[:12]} ({model.path}) here: "
                            "start both with the same --model")
        if handle.block_size != bs:
            problems.append(f"block size {handle.block_size} there, {bs} here: "
                            "start both with the same --block-size")
        if not problems:
            return
        StoreSession(self.store, self._store_failed).release(handle.lease_id)
        raise DeploymentMismatch(
            f"the prefill service at {prefill_addr} does not match this decode service: " + "; ".join(problems)
        )

    def _sampler(self, params: SamplingParams) -> Sampler:
        # Prefill drew the first token from this seed; decode continues on a stream of its own.
        seed = None if params.seed is None else (params.seed + 1) % 2**64
        return Sampler(SamplingParams(params.temperature, params.top_k, params.top_p, seed), self.engine.model.device)

    def _decode(
        self, seq: Sequence, generation: Generation, cancel: Cancellation, state: RequestState, t_first: float
    ) -> Iterator[TokenOutput]:
        """Streams the engine's tokens through ``generation`` until the sequence has left the engine (its
        KV saved). On any exit before that (the client went away, a failure here), the sequence is
        aborted and this waits until the engine has let go of it."""
        m = self.metrics
        try:
            self.engine.add(seq)
        except RuntimeError as exc:  # the engine has stopped
            raise Unavailable("the decode service is shutting down") from exc
        state.in_engine = True
        m.waiting.dec()
        m.running.inc()
        cancel.on_cancel(lambda: self._abort(seq))
        finished: Finished | None = None
        last_sent = t_first
        try:
            while finished is None:
                event = seq.events.get()
                if isinstance(event, Finished):
                    finished = event
                elif not generation.finished:  # tokens past a stop string are dropped
                    out = generation.accept(event.token_id)
                    now = time.perf_counter()
                    m.itl.observe(now - last_sent)
                    last_sent = now
                    yield out
                    if generation.finished and event.finish_reason is None:  # a stop string: the engine goes on
                        self._abort(seq, save=True)
        finally:
            if finished is None:
                self._abort(seq)
                while not isinstance(seq.events.get(), Finished):
                    pass
            m.running.dec()
        if generation.finished:
            return
        if finished.reason == "aborted":
            state.outcome = "cancelled"
        elif finished.reason == "shutdown":
            raise Unavailable(finished.error or "the decode service is shutting down")
        else:
            raise ServiceError(f"generation failed: {finished.error or finished.reason}")

    def _abort(self, seq: Sequence, save: bool = False) -> None:
        with contextlib.suppress(RuntimeError):  # the engine has stopped; it finishes every sequence itself
            self.engine.abort(seq, save=save)

    def _count_kv(self, seq: Sequence, kv: DecodeKV, request_id: str) -> None:
        m = self.metrics
        if kv.error is not None:
            m.bad_blocks.labels(kind=kv.error.kind).inc()
        m.stored_blocks.inc(kv.num_stored)
        recomputed = max(0, seq.stats.num_engine_computed_tokens - 1)  # the first token's KV is always computed here
        if recomputed:
            m.recomputed_tokens.inc(recomputed)
            log.info("request %s: recomputed %d prompt tokens whose KV was not in the store", request_id, recomputed)
