"""Generate: the front door's domain logic (DESIGN.md, "Request flow", steps 6-8).

Prefill computes the prompt and samples the first token, which is sent at once; decode then
fetches the prompt's KV from the store (recomputing what is missing), generates in the shared
decode loop, and finally stores the KV blocks of the generated tokens so that the next turn of a
chat hits the cache on the reply as well as on the prompt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from decode_service.kv_loader import LoadedPrompt, load_prompt_kv
from decode_service.metrics import DecodeMetrics
from decode_service.scheduler import Cancellation, DecodeEntry, Scheduler, Stopped
from decode_service.stopping import Generation, TokenOutput
from engine.engine import Engine
from engine.hashing import Namespace, prefix_hashes
from engine.kv_codec import encode_block
from engine.model import max_new_tokens
from engine.sampling import Sampler, SamplingParams
from kvstore import KVStoreClient
from prefill_service.client import PrefillCancelled, PrefillClient
from serving.cache_session import StoreSession
from serving.errors import FailedPrecondition, ServiceError, Unavailable
from serving.metrics import outcome_of
from serving.requests import PrefillHandle, PromptInput, RequestOptions

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
    """How a request ended when it ends without an exception (e.g. cancelled), and its decode entry."""

    def __init__(self) -> None:
        self.outcome = "ok"
        self.entry: DecodeEntry | None = None
        self.result_sent = False  # past this, a client that hangs up has cancelled nothing


class DecodeService:
    def __init__(
        self, engine: Engine, store: KVStoreClient, prefill: PrefillClient, metrics: DecodeMetrics,
        max_batch_size: int = 32,
    ) -> None:
        self.engine = engine
        self.store = store
        self.prefill = prefill
        self.metrics = metrics
        self.engine_lock = threading.Lock()
        self.scheduler = Scheduler(engine, self.engine_lock, metrics, max_batch_size=max_batch_size)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
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
            if state.entry is None or not state.entry.admitted:
                m.waiting.dec()
            m.requests.labels(outcome=state.outcome).inc()

    def _generate(
        self, job: GenerateJob, cancel: Cancellation, state: RequestState
    ) -> Iterator[TokenOutput | GenerateOutcome]:
        m, engine, opts = self.metrics, self.engine, job.options
        if self.scheduler.stopping:
            raise Unavailable("the decode service is shutting down")
        call = self.prefill.start(job.request_id, job.prompt, opts, time_left_s=job.time_left_s)
        cancel.on_cancel(call.cancel)
        try:
            handle = call.result()
        except PrefillCancelled:
            state.outcome = "cancelled"
            return
        t_prefilled = time.perf_counter()
        self._check_same_deployment(handle)
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

        namespace = engine.namespace(opts.cache_salt)
        store = StoreSession(self.store, self._store_failed)
        if first.finish_reason is None:
            loaded = self._load(store, handle, namespace)
            state.entry = DecodeEntry(loaded.seq, self._sampler(opts.sampling), generation, first.token_id, cancel)
            try:
                yield from self._decode(state, t_first)
                if generation.finished and opts.prefix_cache:
                    self._put_generated(store, loaded, generation, namespace)
            finally:  # the loop has let go of the sequence (see _decode)
                with self.engine_lock:
                    engine.release(loaded.seq)
        else:
            store.release(handle.lease_id)
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

    def _check_same_deployment(self, handle: PrefillHandle) -> None:
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
            f"the prefill service at {self.prefill.addr} does not match this decode service: " + "; ".join(problems)
        )

    @staticmethod
    def _sampler(params: SamplingParams) -> Sampler:
        # Prefill drew the first token from this seed; decode continues on a stream of its own.
        seed = None if params.seed is None else (params.seed + 1) % 2**64
        return Sampler(SamplingParams(params.temperature, params.top_k, params.top_p, seed))

    def _load(self, store: StoreSession, handle: PrefillHandle, namespace: Namespace) -> LoadedPrompt:
        loaded = load_prompt_kv(self.engine, self.engine_lock, store, handle, namespace)
        store.release(handle.lease_id)
        if loaded.bad_block is not None:
            self.metrics.bad_blocks.labels(kind=loaded.bad_block.kind).inc()
        if loaded.num_recomputed_tokens:
            self.metrics.recomputed_tokens.inc(loaded.num_recomputed_tokens)
            log.info("request %s: recomputed %d prompt tokens whose KV was not in the store",
                     handle.request_id, loaded.num_recomputed_tokens)
        return loaded

    def _decode(self, state: RequestState, t_first: float) -> Iterator[TokenOutput]:
        """Streams the loop's tokens; on any exit before the last, takes the entry out of the loop
        and waits until the loop has let go of its sequence."""
        entry = state.entry
        assert entry is not None
        self.scheduler.submit(entry)
        results = entry.results()
        last_sent = t_first
        try:
            for out in results:
                if isinstance(out, Stopped):
                    if out.reason == "cancelled":
                        state.outcome = "cancelled"
                        return
                    if out.reason == "shutdown":
                        raise Unavailable(out.error)
                    raise ServiceError(f"generation failed: {out.error}")
                now = time.perf_counter()
                self.metrics.itl.observe(now - last_sent)
                last_sent = now
                yield out
        finally:
            if not entry.generation.finished:
                entry.cancel.cancel()
                for _ in results:
                    pass

    def _put_generated(
        self, store: StoreSession, loaded: LoadedPrompt, generation: Generation, namespace: Namespace
    ) -> None:
        """Puts the full blocks of prompt + generated tokens that the store does not hold yet."""
        bs = self.engine.block_size
        tokens = [*generation.prompt_token_ids, *generation.token_ids]
        num_blocks = min(len(loaded.seq.token_ids), len(tokens)) // bs
        start = loaded.num_stored_blocks
        if num_blocks <= start:
            return
        assert loaded.seq.token_ids[: num_blocks * bs] == tokens[: num_blocks * bs]
        hashes = prefix_hashes(tokens[: num_blocks * bs], bs, namespace.root())
        with self.engine_lock:
            blocks = self.engine.full_blocks(loaded.seq, start)[: num_blocks - start]
        payloads = [encode_block(kv, namespace) for kv in blocks]
        self.metrics.stored_blocks.inc(store.put(zip(hashes[start:], payloads, strict=True)))
