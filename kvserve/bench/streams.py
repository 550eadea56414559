"""Streamed requests as a benchmark client sees them: when each was sent, when each token arrived
(`time.perf_counter`), and its final result; one request at a time, or many at once on one asyncio loop."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from client.client import AsyncClient, Chunk, Client, Result, Usage


@dataclass(slots=True)
class StreamTrace:
    """What the client saw of one streamed request: each token and when it arrived (perf_counter)."""

    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    result: Result | None = None
    end: float = 0.0  # when the final result arrived
    sent: float = 0.0  # just before the request was sent

    def take(self, item: Chunk | Result) -> None:
        """Records a streamed token, or the result, as it arrives."""
        now = time.perf_counter()
        if isinstance(item, Result):
            self.result, self.end = item, now
        else:
            self.token_ids.append(item.token_id)
            self.arrivals.append(now)

    def gaps(self) -> list[tuple[float, float]]:
        """(previous token's arrival, this token's arrival) for every token after the first."""
        return list(zip(self.arrivals, self.arrivals[1:], strict=False))

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def e2e_s(self) -> float:
        return self.end - self.sent

    def itl_s(self) -> list[float]:
        return [b - a for a, b in self.gaps()]

    @property
    def usage(self) -> Usage:
        assert self.result is not None, "the stream has not finished"
        return self.result.usage


def stream_into(client: Client, trace: StreamTrace, **request: Any) -> None:
    for item in client.stream(**request):
        trace.take(item)


def timed_stream(client: Client, start_at: float | None = None, **request: Any) -> StreamTrace:
    """Streams one request, sent at `start_at` (perf_counter; now if None or past), to its end."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.perf_counter()))
    trace = StreamTrace(sent=time.perf_counter())
    stream_into(client, trace, **request)
    return trace


class StreamLoop:
    """One `AsyncClient` to the front door at `addr` (plaintext, no token) on an asyncio loop in a thread of its
    own: what `Streams` sends from, and keeps connected from one run to the next. The client shares the stack's
    cores: this takes 89-103 us of CPU a token at 16 streams, the sync client with a thread per stream 111-134."""

    def __init__(self, addr: str, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-streams", daemon=True)
        self._thread.start()
        self.client = self.submit(self._client(addr, timeout_s)).result()

    @staticmethod
    async def _client(addr: str, timeout_s: float) -> AsyncClient:
        return AsyncClient(addr, timeout_s=timeout_s)  # made on the loop its channel runs on

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        self.submit(self.client.close()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> StreamLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Streams:
    """Requests streamed concurrently from `start()` on, each a task on `loop`."""

    def __init__(self, loop: StreamLoop, requests: list[dict[str, Any]]) -> None:
        self.loop = loop
        self.requests = requests
        self.traces = [StreamTrace() for _ in requests]
        self._futures: list[Future[None]] = []

    async def _stream(self, trace: StreamTrace, request: dict[str, Any]) -> None:
        async for item in self.loop.client.stream(**request):
            trace.take(item)

    def start(self) -> float:
        """Sends every request; returns the time just before the first was sent."""
        t0 = time.perf_counter()
        for t in self.traces:
            t.sent = t0
        self._futures = [self.loop.submit(self._stream(t, r)) for t, r in zip(self.traces, self.requests, strict=True)]
        return t0

    def wait_for(self, num_tokens: int, timeout_s: float) -> None:
        """Until every stream has received `num_tokens` tokens (or ended)."""
        deadline = time.monotonic() + timeout_s
        while any(len(t.arrivals) < num_tokens and not f.done() for t, f in zip(self.traces, self._futures,
                                                                                  strict=True)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the streams did not reach {num_tokens} tokens in {timeout_s:.0f} s")
            time.sleep(0.01)
        for f in self._futures:
            if f.done():
                f.result()  # a failed stream raises here

    def run(self) -> tuple[float, list[StreamTrace]]:
        """``start`` then ``join``: (the time just before the first request was sent, the traces)."""
        t0 = self.start()
        return t0, self.join()

    def join(self) -> list[StreamTrace]:
        """Every stream's trace; the first that failed raises here, and the others are cancelled."""
        try:
            for f in self._futures:
                f.result()
        finally:
            for f in self._futures:
                f.cancel()
        return self.traces
