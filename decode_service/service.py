"""Generate: the front door's domain logic (docs/DESIGN.md, "Request flow", steps 6-8).

Prefill computes the prompt and samples the first token, which is sent at once; decode then
fetches the prompt's KV from the store (recomputing what is missing), generates in the shared
decode loop, and stores the KV blocks of the generated tokens as they fill, so that the next turn
of a chat hits the cache on the reply as well as on the prompt, and a replica that continues the
stream after this one died (``GenerateJob.resume``) finds them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc

from decode_service.cancellation import Cancellation
from decode_service.metrics import DecodeMetrics
from decode_service.stopping import Generation, TokenOutput
from kvserve.engine.engine import Engine, RequestTooLarge
from kvserve.engine.hashing import prefix_hashes
from kvserve.engine.model import max_new_tokens
from kvserve.engine.sampling import Sampler
from kvserve.engine.sequence import Finished, Sequence
from kvserve.handoff.decode_kv import DecodeKV
from kvserve.handoff.requests import PrefillHandle, PromptInput, RequestOptions, check_text_fits, encode
from kvserve.handoff.session import StoreSession
from kvserve.rpc.admission import Admission
from kvserve.rpc.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from kvserve.rpc.metrics import outcome_of
from kvstore import KVStoreClient
from prefill_service.client import PrefillCall, PrefillCancelled, PrefillReplicas, UpstreamError

log = logging.getLogger(__name__)

LOCAL, DISAGGREGATED = "local", "disaggregated"  # where a request's prompt was computed
DEFAULT_LOCAL_PREFILL_TOKENS = 512  # see --local-prefill-tokens and docs/DESIGN.md, "Local prefill"
LEASE_TTL_S = 30.0  # pins the store's blocks of a prompt computed here until the engine has loaded them
# Requests waiting for their first token, and their prompt tokens (--max-waiting-seqs, --max-waiting-tokens).
DEFAULT_MAX_WAITING_SEQS = 128
DEFAULT_MAX_WAITING_TOKENS = 65536
FALLBACKS = {  # prefill's statuses after which this engine computes the prompt, by the reason counted
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.INTERNAL: "failed",
    grpc.StatusCode.UNKNOWN: "failed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "failed",
}


@dataclass(frozen=True, slots=True)
class GenerateJob:
    request_id: str
    prompt: PromptInput
    options: RequestOptions
    arrival: float  # time.perf_counter() when the request arrived
    time_left_s: float | None = None  # the client's deadline, if it set one: the time left at arrival
    resume: tuple[int, ...] = ()  # tokens a replica that died already sent the caller (resume_token_ids)

    def remaining_s(self) -> float | None:
        """The time left now before the client's deadline (None: it set none)."""
        return None if self.time_left_s is None else self.time_left_s - (time.perf_counter() - self.arrival)


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
    prefill_path: str  # LOCAL or DISAGGREGATED


@dataclass(frozen=True, slots=True)
class GenerateOutcome:
    finish_reason: str
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    usage: Usage
    timings: Timings


@dataclass(frozen=True, slots=True)
class CachedPrompt:
    """A prompt (a resumed stream's tokens after it), the leading blocks of them that this engine's pool or the
    store hold, leased in ``kv`` until the engine has loaded them; ``num_stored_blocks``: the store's from the
    first block, for prefill (None where the lookup asked only past the pool's, or the prefix cache is off)."""

    token_ids: tuple[int, ...]
    num_tokens: int  # with the resumed tokens
    num_cached_blocks: int
    num_stored_blocks: int | None
    kv: DecodeKV

    def num_uncached_tokens(self, block_size: int) -> int:
        return self.num_tokens - self.num_cached_blocks * block_size


class DeploymentMismatch(FailedPrecondition):
    """Prefill and decode serve different models or block sizes: one deployment must agree."""


class RequestState:
    """How a request ended when it ends without an exception (e.g. cancelled)."""

    def __init__(self) -> None:
        self.outcome = "ok"
        self.in_engine = False  # past this, the request no longer counts as waiting
        self.result_sent = False  # past this, a client that hangs up has cancelled nothing


class DecodeService:
    """``local_prefill_tokens``: a prompt whose uncached part is at most this many tokens is computed in this
    engine rather than by the prefill service (0: every prompt goes to prefill). ``admission`` bounds the
    requests waiting for their first token (rpc.admission): one past it is RESOURCE_EXHAUSTED before
    anything is computed."""

    def __init__(self, engine: Engine, store: KVStoreClient, prefill: PrefillReplicas, metrics: DecodeMetrics,
                 local_prefill_tokens: int = 0, admission: Admission | None = None) -> None:
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        self.local_prefill_tokens = local_prefill_tokens
        self.engine = engine
        self.store = store
        self.prefill = prefill
        self.metrics = metrics
        self.admission = admission or Admission("decode", DEFAULT_MAX_WAITING_SEQS, DEFAULT_MAX_WAITING_TOKENS)
        self._stopping = False
        engine.on_step = metrics.engine.observe
        metrics.engine.show_attention(engine.runner.attention)  # what this engine runs (its device, its dtype)

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self._stopping = True
        self.engine.stop()
        self.prefill.close()

    @staticmethod
    def _check_caller_left(cancel: Cancellation) -> None:
        """A prefill call that ended CANCELLED: the caller's leaving, else this service closing its channels as it
        stops (UNAVAILABLE, so that a router asks another replica, instead of an empty stream that ends OK)."""
        if not cancel.cancelled:
            raise Unavailable("the decode service is shutting down: its call to prefill was cut")

    def _store_failed(self, op: str) -> None:
        self.metrics.store_failures.labels(op=op).inc()

    def refused(self, error: BaseException) -> None:
        """Counts a request refused before it became a job (bad input, no valid token)."""
        self.metrics.requests.labels(outcome=outcome_of(error)).inc()

    def generate(self, job: GenerateJob, cancel: Cancellation) -> Iterator[TokenOutput | GenerateOutcome]:
        """Streams each token as it is sampled, then the outcome. Returns early, quietly, once
        `cancel` fires (the client went away): the work it caused stops."""
        m = self.metrics
        state = RequestState()
        ticket = None
        m.waiting.inc()
        try:
            self._refuse_early(job)
            # Tokenized once, here: admission counts the tokens, and prefill or this engine take the ids.
            ids = tuple(encode(self.engine.model, job.prompt))
            job = replace(job, prompt=PromptInput(token_ids=ids))
            self._check_fits(job, len(ids))  # exact for a text now (token ids: checked so already)
            ticket = self.admission.admit(len(ids) + len(job.resume), job.time_left_s)
            for item in self._generate(job, cancel, state):
                if isinstance(item, TokenOutput):
                    ticket.computed()
                yield item
        except BaseException as exc:
            if not (state.result_sent and isinstance(exc, GeneratorExit)):
                state.outcome = outcome_of(exc)
            raise
        finally:
            if ticket is not None:
                ticket.release()
            if not state.in_engine:
                m.waiting.dec()
            m.requests.labels(outcome=state.outcome).inc()

    def _refuse_early(self, job: GenerateJob) -> None:
        """What needs no tokenizer, before it runs: a request that can never fit is refused as such whatever the
        load (token ids counted, `_check_fits`; a text's tokens bounded below by its bytes, `check_text_fits`),
        then, while the waiting requests or tokens are at their bound, any other as busy, with a retry hint."""
        if job.prompt.token_ids is not None:
            self._check_fits(job, len(job.prompt.token_ids))
        else:
            check_text_fits(self.engine.model, job.prompt, job.options.max_tokens)
        busy = self.admission.refusal()
        if busy is None:
            return
        if job.prompt.token_ids is None and _may_not_fit(self.engine.model.max_positions, job):
            # Only a text long enough that it may not fit is tokenized here (as every request is below the bound):
            # a short one cannot pass the positions, and is refused as busy at once.
            ids = tuple(encode(self.engine.model, job.prompt))
            self._check_fits(replace(job, prompt=PromptInput(token_ids=ids)), len(ids))
        raise busy

    def _check_fits(self, job: GenerateJob, num_prompt: int) -> None:
        """Refuses a request that no load could let run, before admission can call it busy (which a client
        retries): prompt + max_tokens past the model's positions (OUT_OF_RANGE) or past the KV pool
        (RESOURCE_EXHAUSTED without a retry hint), or resumed tokens that max_tokens does not cover."""
        engine, opts = self.engine, job.options
        max_tokens = max_new_tokens(engine.model, num_prompt, opts.max_tokens)
        need = engine.scheduler.blocks_needed(num_prompt + max_tokens)
        if need > engine.pool.num_blocks:  # as Engine.add would, after the prompt was computed
            raise RequestTooLarge(
                f"{num_prompt} prompt tokens + {max_tokens} to generate need {need} KV blocks of "
                f"{engine.block_size} tokens; the KV pool holds {engine.pool.num_blocks} "
                "(raise --kv-cache-memory, or send a shorter request)")
        if job.resume:
            self._check_resume(job.resume, max_tokens, opts.max_tokens)

    def _generate(
        self, job: GenerateJob, cancel: Cancellation, state: RequestState
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        if self._stopping:
            raise Unavailable("the decode service is shutting down")
        if job.resume:
            yield from self._generate_resumed(job, cancel, state)
            return
        prompt = self._cached_prompt(job)  # the request's one store lookup: prefill is told what it found
        try:
            yield from self._generate_new(job, prompt, cancel, state)
        finally:
            prompt.kv.release_leases()

    def _generate_new(
        self, job: GenerateJob, prompt: CachedPrompt, cancel: Cancellation, state: RequestState
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        """Computed here when what the pool and the store do not hold is at most --local-prefill-tokens, or when
        prefill could not; by prefill otherwise."""
        if prompt.num_uncached_tokens(self.engine.block_size) > self.local_prefill_tokens:
            try:
                call, handle = self._first_answer(job, cancel, prompt.num_stored_blocks)
            except PrefillCancelled:
                self._check_caller_left(cancel)
                state.outcome = "cancelled"
                return
            except (Unavailable, UpstreamError) as exc:  # prefill could not: this engine computes the prompt
                reason = self._fallback_reason(job, exc)
                if reason is None:
                    raise
                self.metrics.prefill_fallbacks.labels(reason=reason).inc()
                log.warning("prefill %s for %s (%s): computing its prompt here", reason, job.request_id, exc)
            else:
                self.metrics.prefills.labels(path=DISAGGREGATED).inc()
                yield from self._generate_disaggregated(job, call, handle, prompt.kv, cancel, state)
                return
        self.metrics.prefills.labels(path=LOCAL).inc()
        yield from self._generate_local(job, prompt, cancel, state)

    @staticmethod
    def _fallback_reason(job: GenerateJob, exc: ServiceError) -> str | None:
        """Why this engine computes the prompt after prefill's ``exc`` (the labels of
        kvserve_decode_prefill_fallbacks_total), or None when ``exc`` goes to the caller: a status about the
        request itself (INVALID_ARGUMENT, OUT_OF_RANGE), or any once the caller's deadline has passed (a
        DEADLINE_EXCEEDED before it is decode's own cap on prefill)."""
        remaining = job.remaining_s()
        if remaining is not None and remaining <= 0:
            return None
        return FALLBACKS.get(exc.code)

    def _generate_resumed(
        self, job: GenerateJob, cancel: Cancellation, state: RequestState
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        """A stream that another replica started and died in, continued as it would have: its prompt and
        resumed tokens computed in this engine (never by prefill, which would sample a first token), the
        next draw at the step after them, their text replayed but not streamed again."""
        engine, opts = self.engine, job.options
        prompt = encode(engine.model, job.prompt)
        max_tokens = max_new_tokens(engine.model, len(prompt), opts.max_tokens)  # resume included: _check_fits
        generation = self._generation(tuple(prompt), max_tokens, opts)
        try:
            generation.replay(job.resume)
        except ValueError as exc:
            raise InvalidArgument(f"resume_token_ids: {exc}") from exc
        if generation.finished:  # the replica died before it sent the result: only that is left
            now = time.perf_counter()
            state.result_sent = True
            yield self._outcome(job, generation, tuple(prompt), 0, now, now, LOCAL)
            return
        cached = self._cached_prompt(job, prompt, local=True)
        try:
            self.metrics.prefills.labels(path=LOCAL).inc()
            yield from self._generate_local(job, cached, cancel, state, generation)
        finally:
            cached.kv.release_leases()

    def _check_resume(self, resume: tuple[int, ...], max_tokens: int, requested: int) -> None:
        if len(resume) > max_tokens:
            default = "" if requested else ", the service's default"
            raise InvalidArgument(f"resume_token_ids has {len(resume)} tokens, more than max_tokens "
                                  f"({max_tokens}{default})")
        vocab = self.engine.model.vocab_size  # a property that walks the model: once, not per token
        bad = next((i for i, t in enumerate(resume) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"resume_token_ids[{bad}] = {resume[bad]} is outside the model's vocabulary "
                                  f"[0, {vocab})")

    def _cached_prompt(self, job: GenerateJob, prompt: list[int] | None = None, local: bool = False) -> CachedPrompt:
        """The prompt, with the leading blocks of it that this engine's pool or the store hold, found by the
        request's one store lookup and leased until the engine has loaded them. Of the blocks past the pool's when
        the prompt is computed here whatever the store holds (``local``, or what the pool lacks is within
        --local-prefill-tokens), else from the first block, so that prefill takes its answer as its own. A resumed
        stream's tokens follow the prompt, their blocks found like the prompt's (the replica that generated them
        saved them as they filled). ``prompt``: job's prompt, encoded and checked already."""
        engine, opts, bs = self.engine, job.options, self.engine.block_size
        if prompt is None:
            prompt = encode(engine.model, job.prompt)
            max_new_tokens(engine.model, len(prompt), opts.max_tokens)  # refused here, before anything is computed
        token_ids = [*prompt, *job.resume]
        namespace = engine.namespace(opts.cache_salt)
        store = StoreSession(self.store, self._store_failed)
        num_cached, num_stored, lease = 0, None, ""
        if opts.prefix_cache:  # never the last token: its logits give the next one
            reusable = prefix_hashes(token_ids[: (len(token_ids) - 1) // bs * bs], bs, namespace.root())
            num_cached = engine.pool_hits(reusable)
            if local or len(token_ids) - num_cached * bs <= self.local_prefill_tokens:
                in_store, lease = store.lookup(reusable[num_cached:], LEASE_TTL_S)
                num_cached += in_store
            else:
                num_stored, lease = store.lookup(reusable, LEASE_TTL_S)
                num_cached = max(num_cached, num_stored)
        kv = DecodeKV(store, namespace, len(token_ids), opts.prefix_cache, leases=[lease])
        return CachedPrompt(tuple(prompt), len(token_ids), num_cached, num_stored, kv)

    def _generate_local(
        self, job: GenerateJob, local: CachedPrompt, cancel: Cancellation, state: RequestState,
        generation: Generation | None = None,
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        """The prompt computed in this engine's batched step, in chunks under its token budget beside the
        streams it runs, then generated on: no hand-off. Its blocks go to the store as they fill (prefix
        cache on) and when it finishes.
        ``generation``: a resumed stream's, its tokens replayed."""
        engine, opts, prompt, resumed = self.engine, job.options, local.token_ids, len(job.resume)
        max_tokens = max_new_tokens(engine.model, len(prompt), opts.max_tokens)
        if generation is None:
            generation = self._generation(prompt, max_tokens, opts)
        seq = Sequence(
            [*prompt, *job.resume], Sampler(opts.sampling, engine.model.device, step=resumed),
            max_new_tokens=max_tokens - resumed,
            stop_token_ids=frozenset() if opts.ignore_eos else engine.model.eos_token_ids,
            hash_root=local.kv.namespace.root() if opts.prefix_cache else None, source=local.kv,
            num_saved_blocks=local.num_cached_blocks, request_id=job.request_id,
        )
        t_first, num_cached = 0.0, 0
        try:
            for out in self._decode(seq, generation, cancel, state, None):
                if not t_first:
                    t_first = time.perf_counter()
                    num_cached = seq.stats.num_pool_hit_tokens + seq.stats.num_loaded_tokens
                    # a resumed stream's tokens count as prompt here: this engine computed them as one
                    self._count_prompt(t_first - job.arrival, seq.num_prompt_tokens, num_cached)
                yield out
        finally:
            local.kv.release_leases()
        self._count_kv(local.kv)
        if generation.finished:
            state.result_sent = True
            yield self._outcome(job, generation, prompt, min(num_cached, len(prompt)), t_first, t_first, LOCAL)

    def _generate_disaggregated(
        self, job: GenerateJob, call: PrefillCall, handle: PrefillHandle, leases: DecodeKV, cancel: Cancellation,
        state: RequestState,
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        """Prefill computed the prompt and sampled the first token, sent at once; the prompt's KV comes
        from the store (what is missing there is recomputed here). ``leases`` holds this request's leases (its
        lookup's, prefill's) until the engine has loaded the prompt's blocks; the caller releases what it holds."""
        engine, opts = self.engine, job.options
        t_prefilled = time.perf_counter()
        leases.hold(handle.lease_id)
        self._check_same_deployment(handle, call.addr)
        prompt = handle.prompt_token_ids
        max_tokens = max_new_tokens(engine.model, len(prompt), opts.max_tokens)
        generation = self._generation(prompt, max_tokens, opts)
        first = generation.accept(handle.first_token_id)
        t_first = time.perf_counter()
        self._count_prompt(t_first - job.arrival, len(prompt), handle.num_cached_tokens)
        yield first
        try:
            handle = self._kv_handle(call, handle)
        except PrefillCancelled:
            self._check_caller_left(cancel)
            state.outcome = "cancelled"
            return

        namespace = engine.namespace(opts.cache_salt)
        kv = DecodeKV.from_handle(leases.store, namespace, handle, opts.prefix_cache, leases.take_leases())
        try:
            if first.finish_reason is None:
                seq = Sequence(
                    [*prompt, first.token_id], Sampler(opts.sampling, engine.model.device, step=1),
                    max_new_tokens=max_tokens - 1,
                    stop_token_ids=frozenset() if opts.ignore_eos else engine.model.eos_token_ids,
                    hash_root=namespace.root() if opts.prefix_cache else None, source=kv,
                    num_saved_blocks=len(prompt) // engine.block_size, request_id=job.request_id,
                )
                yield from self._decode(seq, generation, cancel, state, t_first)
                self._count_kv(kv)
                self._count_recomputed(seq, handle.request_id)
        finally:
            kv.release_leases()
        if generation.finished:
            state.result_sent = True
            yield self._outcome(job, generation, prompt, handle.num_cached_tokens, t_prefilled, t_first,
                                DISAGGREGATED)

    def _generation(self, prompt: tuple[int, ...], max_tokens: int, opts: RequestOptions) -> Generation:
        model = self.engine.model
        return Generation(model.tokenizer, prompt, max_tokens, model.eos_token_ids, stop=opts.stop,
                          ignore_eos=opts.ignore_eos)

    def _count_prompt(self, ttft_s: float, num_prompt: int, num_cached: int) -> None:
        m = self.metrics
        m.ttft.observe(ttft_s)
        m.prompt_tokens.inc(num_prompt)
        m.cached_tokens.inc(num_cached)
        m.computed_tokens.inc(num_prompt - num_cached)

    def _outcome(self, job: GenerateJob, generation: Generation, prompt: tuple[int, ...], num_cached: int,
                 t_prefilled: float, t_first: float, path: str) -> GenerateOutcome:
        done = time.perf_counter()
        self.metrics.generated_tokens.inc(len(generation.token_ids) - len(job.resume))  # the rest were elsewhere
        self.metrics.e2e.observe(done - job.arrival)
        return GenerateOutcome(
            finish_reason=generation.finish_reason or "",
            text=generation.text,
            token_ids=tuple(generation.token_ids),
            prompt_token_ids=prompt,
            usage=Usage(len(prompt), num_cached, len(generation.token_ids)),
            timings=Timings(ttft_s=t_first - job.arrival, prefill_s=t_prefilled - job.arrival,
                            decode_s=done - t_first, total_s=done - job.arrival, prefill_path=path),
        )

    def _first_answer(self, job: GenerateJob, cancel: Cancellation, num_stored_blocks: int | None
                      ) -> tuple[PrefillCall, PrefillHandle]:
        """The prefill call and its first answer. A prefill replica that is unavailable (restarting, its
        connection dropped) is marked down and another asked, or the same one once more when it is the
        only one: the call is idempotent, it only fills a cache. ``num_stored_blocks``: what this request's
        lookup found in the store, so that prefill does not look again."""
        tried: list[str] = []
        attempts = max(2, len(self.prefill.clients))
        for attempt in range(1, attempts + 1):
            call = self.prefill.start(job.request_id, job.prompt, job.options, time_left_s=job.remaining_s(),
                                      avoid=tried,  # the caller's deadline: what went on before counts
                                      num_stored_blocks=num_stored_blocks)
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
        vocab = model.vocab_size
        if not all(0 <= t < vocab for t in (*handle.prompt_token_ids, handle.first_token_id)):
            problems.append(f"token ids outside this model's vocabulary [0, {vocab})")
        if not problems:
            return
        raise DeploymentMismatch(  # the handle's lease is held with the request's, released as it ends
            f"the prefill service at {prefill_addr} does not match this decode service: " + "; ".join(problems)
        )

    def _decode(
        self, seq: Sequence, generation: Generation, cancel: Cancellation, state: RequestState,
        t_first: float | None,
    ) -> Iterator[TokenOutput]:
        """Streams the engine's tokens through ``generation`` until the sequence has left the engine (its
        KV saved); ``t_first`` is when the first token was sent, None when it is the engine's first. On any exit before that (the client went away, a failure here), the sequence is
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
                    if last_sent is not None:
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

    def _count_kv(self, kv: DecodeKV) -> None:
        m = self.metrics
        if kv.error is not None:
            m.bad_blocks.labels(kind=kv.error.kind).inc()
        m.stored_blocks.inc(kv.num_stored)

    def _count_recomputed(self, seq: Sequence, request_id: str) -> None:
        m = self.metrics
        recomputed = max(0, seq.stats.num_engine_computed_tokens - 1)  # the first token's KV is always computed here
        if recomputed:
            m.recomputed_tokens.inc(recomputed)
            log.info("request %s: recomputed %d prompt tokens whose KV was not in the store", request_id, recomputed)


TEMPLATE_TOKENS = 512  # the most tokens a chat template adds around the messages, with room to spare


def _may_not_fit(positions: int | None, job: GenerateJob) -> bool:
    """Whether a text prompt may pass the model's positions: no token covers less than a byte, so one whose
    bytes (and a template's tokens) fit cannot."""
    if positions is None:
        return False
    prompt = job.prompt
    texts = [prompt.text] if prompt.text is not None else [c for _, c in prompt.messages or ()]
    return sum(len(t.encode()) for t in texts) + TEMPLATE_TOKENS > positions - max(job.options.max_tokens, 1)
