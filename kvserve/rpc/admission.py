"""Admission control: a bound on the work waiting in a service, and a fast no past it.

A request waits from its arrival until its prompt is computed (decode: its first token is sent;
prefill: its first token is sampled). While it waits it counts as one sequence and its prompt's
tokens. A request that would take the waiting work past `max_seqs` or `max_tokens`, or whose caller's
deadline is shorter than the measured time to compute the tokens already waiting ahead of it, is
refused at once with RESOURCE_EXHAUSTED and a retry hint, instead of queueing until it dies at its
deadline.

The rate is measured, not configured: prompt tokens computed per second of the time the queue was not
empty (while it is empty nobody waits, and the service's capacity is not what limits the rate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvserve.rpc.errors import ResourceExhausted

# The retry hint: the measured time to drain what waits, within these bounds.
MIN_RETRY_S, MAX_RETRY_S = 0.1, 30.0
# How much the rate's running average moves towards each new measurement: a few requests' worth of memory.
RATE_WEIGHT = 0.2


class Ticket:
    """One admitted request's place in the waiting work. `computed()` once its prompt is (it leaves the
    queue and counts towards the rate); `release()` however it ends (idempotent; after `computed`, a no-op)."""

    def __init__(self, admission: Admission, num_tokens: int) -> None:
        self._admission = admission
        self.num_tokens = num_tokens
        self._done = False

    def computed(self) -> None:
        if not self._done:
            self._done = True
            self._admission._leave(self.num_tokens, computed=True)

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._admission._leave(self.num_tokens, computed=False)


class Admission:
    def __init__(self, service: str, max_seqs: int, max_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_seqs < 1 or max_tokens < 1:
            raise ValueError(f"the waiting bounds must be at least 1, got {max_seqs} sequences, {max_tokens} tokens")
        self.service = service
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self._clock = clock
        self._lock = threading.Lock()
        self.seqs = 0  # waiting now
        self.tokens = 0
        self.rate: float | None = None  # prompt tokens computed per busy second, once measured
        self._busy_since: float | None = None  # the queue has not been empty since
        self._busy_tokens = 0  # tokens computed since then

    def admit(self, num_tokens: int, time_left_s: float | None = None) -> Ticket:
        """A ticket for a request of `num_tokens` prompt tokens, or ResourceExhausted (with a retry hint)
        when it does not fit the bounds, or the tokens waiting ahead of it take longer than `time_left_s`
        at the measured rate. A request alone always fits: one larger than the bounds waits for nobody."""
        with self._lock:
            refusal = self._refusal(num_tokens, time_left_s)
            if refusal is not None:
                raise refusal
            if not self.seqs:
                self._busy_since, self._busy_tokens = self._clock(), 0
            self.seqs += 1
            self.tokens += num_tokens
        return Ticket(self, num_tokens)

    def refusal(self) -> ResourceExhausted | None:
        """The refusal any request arriving now would get, or None; it counts nothing. What prefill checks as a
        call arrives, before a worker reads its request (rpc.server.Server.check_on_arrival), and decode once the
        request is read, before it tokenizes it; `admit` still decides for the requests this lets through."""
        with self._lock:
            return self._refusal(1, None)

    def _refusal(self, num_tokens: int, time_left_s: float | None) -> ResourceExhausted | None:
        why = ""
        if self.seqs and self.seqs + 1 > self.max_seqs:
            why = f"{self.seqs} requests wait for their prompt to be computed, its limit (--max-waiting-seqs)"
        elif self.seqs and self.tokens + num_tokens > self.max_tokens:
            why = (f"{self.tokens} prompt tokens wait to be computed, and {num_tokens} more would pass its "
                   f"limit of {self.max_tokens} (--max-waiting-tokens)")
        elif time_left_s is not None and self.rate and self.tokens / self.rate > time_left_s:
            why = (f"the {self.tokens} prompt tokens waiting ahead take about {self.tokens / self.rate:.1f} s "
                   f"to compute, past this request's deadline ({time_left_s:.1f} s)")
        if not why:
            return None
        wait = self.tokens / self.rate if self.rate else MIN_RETRY_S
        return ResourceExhausted(f"the {self.service} service is busy: {why}; retry later",
                                 retry_after_s=min(MAX_RETRY_S, max(MIN_RETRY_S, wait)))

    def _leave(self, num_tokens: int, *, computed: bool) -> None:
        with self._lock:
            self.seqs -= 1
            self.tokens -= num_tokens
            if computed:
                self._busy_tokens += num_tokens
                busy_s = self._clock() - (self._busy_since or 0.0)
                if busy_s > 0:
                    rate = self._busy_tokens / busy_s
                    self.rate = rate if self.rate is None else (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * rate
            if not self.seqs:
                self._busy_since = None
