"""The decode loop: one thread steps every running sequence together (continuous batching).

Requests join between steps and leave when they finish or are cancelled; each step feeds one
token per sequence through `Engine.decode_step` and samples the next. A request's thread reads
its tokens from its own queue. The engine lock is shared with the request threads, which use the
engine between steps (loading a prompt's KV, reading finished blocks).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from decode_service.metrics import DecodeMetrics
from decode_service.stopping import Generation, TokenOutput
from engine.engine import Engine, Sequence, StepFailed
from engine.sampling import Sampler

log = logging.getLogger(__name__)


class Cancellation:
    """Set once, from any thread (e.g. gRPC's RPC-termination callback); runs listeners once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._listeners: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn()

    def on_cancel(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._cancelled:
                self._listeners.append(fn)
                return
        fn()


@dataclass(frozen=True, slots=True)
class Stopped:
    """The loop let go of a request without finishing it: cancelled, engine failure or shutdown."""

    reason: str
    error: str = ""


@dataclass(eq=False, slots=True)
class DecodeEntry:
    """A sequence in the decode loop; `next_token` is sampled but not yet fed."""

    seq: Sequence
    sampler: Sampler
    generation: Generation
    next_token: int
    cancel: Cancellation
    outputs: queue.SimpleQueue[TokenOutput | Stopped] = field(default_factory=queue.SimpleQueue)
    admitted: bool = False

    def results(self) -> Iterator[TokenOutput | Stopped]:
        """Blocks for each output until the last one (a finishing TokenOutput or a Stopped)."""
        while True:
            out = self.outputs.get()
            yield out
            if isinstance(out, Stopped) or out.finish_reason is not None:
                return


class Scheduler:
    def __init__(self, engine: Engine, engine_lock: threading.Lock, metrics: DecodeMetrics,
                 max_batch_size: int = 32) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self._engine_lock = engine_lock
        self._metrics = metrics
        self._cond = threading.Condition()
        self._waiting: deque[DecodeEntry] = deque()
        self._running: list[DecodeEntry] = []  # only the loop thread touches it
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def submit(self, entry: DecodeEntry) -> None:
        with self._cond:
            if self._stopping:
                entry.outputs.put(Stopped("shutdown", "the decode service is shutting down"))
                return
            self._waiting.append(entry)
            self._cond.notify()
        entry.cancel.on_cancel(self._wake)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _admit(self) -> bool:
        """Moves waiting entries into the batch; drops cancelled ones. False once stopping."""
        with self._cond:
            while not self._stopping and not self._waiting and not self._running:
                self._cond.wait()
            if self._stopping:
                return False
            for entry in [e for e in self._waiting if e.cancel.cancelled]:
                self._waiting.remove(entry)
                entry.outputs.put(Stopped("cancelled"))
            while self._waiting and len(self._running) < self.max_batch_size:
                entry = self._waiting.popleft()
                entry.admitted = True
                self._running.append(entry)
                self._metrics.waiting.dec()
                self._metrics.running.inc()
        for entry in [e for e in self._running if e.cancel.cancelled]:
            self._leave(entry, Stopped("cancelled"))
        return True

    def _leave(self, entry: DecodeEntry, last: TokenOutput | Stopped) -> None:
        self._running.remove(entry)
        self._metrics.running.dec()
        entry.outputs.put(last)

    def _loop(self) -> None:
        while self._admit():
            if self._running:
                self._step(list(self._running))
        for entry in list(self._running):
            self._leave(entry, Stopped("shutdown", "the decode service is shutting down"))
        with self._cond:
            while self._waiting:
                self._waiting.popleft().outputs.put(Stopped("shutdown", "the decode service is shutting down"))

    def _fail(self, entry: DecodeEntry, exc: Exception) -> None:
        log.error("decoding failed for one sequence: %s: %s", type(exc).__name__, exc)
        self._leave(entry, Stopped("error", f"the decode step failed: {type(exc).__name__}: {exc}"))

    def _step(self, batch: list[DecodeEntry]) -> None:
        """One token for every sequence of the batch. A failure fails only the requests it touches;
        the loop goes on."""
        self._metrics.batch_size.observe(len(batch))
        failed: set[int] = set()
        try:
            with self._engine_lock:
                logits = self.engine.decode_step([e.seq for e in batch], [e.next_token for e in batch])
        except StepFailed as exc:
            logits, failed = exc.logits, set(exc.errors)
            for i, error in exc.errors.items():
                self._fail(batch[i], error)
        except Exception as exc:  # no sequence's state is known: the batch fails, the loop goes on
            log.exception("decode step failed for %d sequences", len(batch))
            for entry in batch:
                self._fail(entry, exc)
            return
        for i, (entry, row) in enumerate(zip(batch, logits, strict=True)):
            if i in failed:
                continue
            try:
                token = entry.sampler.sample(row)
                out = entry.generation.accept(token)
            except Exception as exc:  # a bad sample or detokenization fails its own request only
                self._fail(entry, exc)
                continue
            entry.next_token = token
            if out.finish_reason is not None:
                self._leave(entry, out)
            else:
                entry.outputs.put(out)
