"""The way to reach the prefill service, as `kvstore.KVStoreClient` is the way to reach the store.

`PrefillClient.start(...)` sends one PrefillStream call under a deadline and returns it while it
runs: the first token arrives before the prompt's KV is stored, and a caller whose own client goes
away can cancel it (the prefill service then skips the forward pass). Errors come back as ServiceErrors a front door can pass on. The request types are
`kvserve.handoff.requests`, the contract both services share.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import grpc

from kvserve.handoff.requests import (
    MalformedHandle,
    PrefillHandle,
    PromptInput,
    RequestOptions,
    handle_from_proto,
    options_to_proto,
    prompt_to_proto,
)
from kvserve.rpc.addresses import Targets, split_targets
from kvserve.rpc.errors import ServiceError, Unavailable
from kvserve.rpc.server import CLIENT_CHANNEL_OPTIONS
from kvserve.rpc.tls import TLSConfig, channel
from protos.kvserve.v1 import prefill_pb2, prefill_pb2_grpc

PASSED_THROUGH = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
})


class UpstreamError(ServiceError):
    """A status from the prefill service, passed on to the client with its code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PrefillCancelled(Exception):
    """The call was cancelled (the caller's client went away) before prefill answered."""


class PrefillCall:
    """One PrefillStream call in flight: the first token comes first (`first`), the handle with the
    prompt's KV in the store after it (`result`)."""

    def __init__(self, call: Iterator[prefill_pb2.PrefillResponse], addr: str, timeout_s: float | None, *,
                 capped: bool = False) -> None:
        """`capped`: the deadline is decode's own cap (--prefill-timeout-s), shorter than the caller's."""
        self._call = call
        self._addr = addr
        self._timeout_s = timeout_s
        self.capped = capped

    @property
    def addr(self) -> str:
        return self._addr

    def on_done(self, fn: Callable[[], None]) -> None:
        """Calls `fn` once the RPC has ended, however it ended."""
        self._call.add_done_callback(lambda _: fn())  # type: ignore[attr-defined]

    def cancel(self) -> None:
        """Cancels the RPC; safe from any thread and after it has finished."""
        self._call.cancel()  # type: ignore[attr-defined]

    def first(self) -> PrefillHandle:
        """Waits for the first answer: the first token (its handle ``kv_pending``, unless prefill sent the
        whole handle at once). PrefillCancelled once cancelled, a ServiceError if prefill failed."""
        return self._next()

    def result(self) -> PrefillHandle:
        """Waits for the handle whose KV is in the store (after `first`, or skipping it)."""
        handle = self._next()
        while handle.kv_pending:
            handle = self._next()
        return handle

    def _next(self) -> PrefillHandle:
        try:
            return handle_from_proto(next(self._call))
        except StopIteration:
            raise UpstreamError(grpc.StatusCode.INTERNAL, f"prefill at {self._addr} ended without a handle") from None
        except MalformedHandle as exc:  # not a prefill service of ours: as one that does not answer
            raise Unavailable(f"the prefill service at {self._addr} answered a malformed hand-off: {exc}") from None
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def _error(self, exc: grpc.RpcError) -> Exception:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if code == grpc.StatusCode.CANCELLED:
            return PrefillCancelled()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            within = f" within {self._timeout_s:.1f} s" if self._timeout_s is not None else ""
            cap = " (decode's --prefill-timeout-s)" if self.capped else " (the caller's deadline)"
            return UpstreamError(code, f"the prefill service at {self._addr} did not answer{within}{cap}")
        if code in PASSED_THROUGH:
            return UpstreamError(code, details or f"prefill failed with {code.name}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(f"the prefill service at {self._addr} is unavailable: {details}")
        return UpstreamError(grpc.StatusCode.INTERNAL, f"prefill at {self._addr} failed ({code.name}): {details}")


class PrefillClient:
    """A channel to one prefill service; a call carries its caller's deadline, capped at `timeout_s` if given."""

    def __init__(self, addr: str, timeout_s: float | None = None, *, tls: TLSConfig | None = None,
                 target_name: str | None = None) -> None:
        """`target_name`: the host name to check the server's certificate against, where `addr` is an
        address resolved from it."""
        self.addr = addr
        self.timeout_s = timeout_s
        options: list[tuple[str, Any]] = list(CLIENT_CHANNEL_OPTIONS)
        if tls is not None and target_name is not None:
            options.append(("grpc.ssl_target_name_override", target_name))
        self._channel = channel(addr, options, tls)
        self._stub = prefill_pb2_grpc.PrefillStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def start(
        self, request_id: str, prompt: PromptInput, options: RequestOptions, *, time_left_s: float | None = None,
        num_stored_blocks: int | None = None,
    ) -> PrefillCall:
        """Sends the Prefill call with a deadline of min(timeout_s, time_left_s) (either may be None: no
        deadline) and returns it in flight. `num_stored_blocks`: the prompt's leading full blocks that the
        caller's own lookup found in the store, leased by the caller until it has loaded them (prefill then
        looks nothing up); None: prefill looks them up."""
        sampling, cache = options_to_proto(options)
        request = prefill_pb2.PrefillRequest(
            request_id=request_id, prompt=prompt_to_proto(prompt), sampling=sampling, cache=cache,
            num_stored_blocks=num_stored_blocks,
        )
        capped = self.timeout_s is not None and (time_left_s is None or self.timeout_s < time_left_s)
        timeout = self.timeout_s if capped else time_left_s
        if timeout is not None:
            timeout = max(0.0, timeout)
        return PrefillCall(self._stub.PrefillStream(request, timeout=timeout), self.addr, timeout, capped=capped)


class PrefillReplicas:
    """The prefill replicas of one node (sharing decode's store): each call goes to the one with the
    fewest calls in flight from here among those not marked down, ties in turn. A replica that
    answered UNAVAILABLE is marked down for `down_s` and the caller asks another (`avoid`). Built by
    `connect` from addresses, a host name that resolves to several addresses is that many replicas,
    resolved again every `resolve_every_s`."""

    def __init__(self, clients: Sequence[PrefillClient], down_s: float = 2.0, *,
                 resolve: Callable[[], Sequence[PrefillClient]] | None = None, resolve_every_s: float = 10.0) -> None:
        self.down_s = down_s
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._in_flight: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self.clients: list[PrefillClient] = []
        self._set(clients)
        self._resolve, self._resolve_every_s = resolve, resolve_every_s
        self._resolved_at = time.monotonic()
        self._resolving = False

    @classmethod
    def connect(cls, addrs: str, timeout_s: float | None = None, *, tls: TLSConfig | None = None,
                resolve_every_s: float = 10.0) -> PrefillReplicas:
        """From a comma-separated list of HOST:PORT."""
        targets = Targets(split_targets(addrs))
        known: dict[str, PrefillClient] = {}

        def clients() -> list[PrefillClient]:
            wanted = targets.resolve()
            for a, name in wanted.items():
                if a not in known:
                    known[a] = PrefillClient(a, timeout_s, tls=tls, target_name=name)
            return [known[a] for a in wanted]

        return cls(clients(), resolve=clients, resolve_every_s=resolve_every_s)

    @property
    def addr(self) -> str:
        return ",".join(c.addr for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def start(self, request_id: str, prompt: PromptInput, options: RequestOptions, *,
              time_left_s: float | None = None, avoid: Collection[str] = (),
              num_stored_blocks: int | None = None) -> PrefillCall:
        """`PrefillClient.start` on the chosen replica; one in `avoid` only when every other is."""
        client = self._pick(avoid)
        call = client.start(request_id, prompt, options, time_left_s=time_left_s, num_stored_blocks=num_stored_blocks)
        call.on_done(lambda: self._done(client.addr))
        return call

    def mark_down(self, addr: str) -> None:
        with self._lock:
            self._down_until[addr] = time.monotonic() + self.down_s

    def _set(self, clients: Sequence[PrefillClient]) -> None:
        self.clients = list(clients)
        for c in clients:
            self._in_flight.setdefault(c.addr, 0)
            self._down_until.setdefault(c.addr, 0.0)

    def _pick(self, avoid: Collection[str]) -> PrefillClient:
        now = time.monotonic()
        if self._resolve is not None and (now - self._resolved_at > self._resolve_every_s or not self.clients):
            self._refresh(self._resolve, now)
        with self._lock:
            if not self.clients:
                raise Unavailable("no prefill replica: the prefill address resolves to no address (yet)")
            k = next(self._turn) % len(self.clients)
            order = self.clients[k:] + self.clients[:k]
            up = [c for c in order if self._down_until[c.addr] <= now and c.addr not in avoid]
            fallback = [c for c in order if c.addr not in avoid] or order
            client = (min(up, key=lambda c: self._in_flight[c.addr]) if up
                      else min(fallback, key=lambda c: self._down_until[c.addr]))
            self._in_flight[client.addr] += 1
            return client

    def _refresh(self, resolve: Callable[[], Sequence[PrefillClient]], now: float) -> None:
        """The replicas resolved again, by one thread at a time and outside the lock (a slow DNS answer holds up
        only this request): the others meanwhile pick among the replicas known. A replica gone keeps its
        channel: calls in flight end on it."""
        with self._lock:
            if self._resolving:
                return
            self._resolving, self._resolved_at = True, now
        try:
            clients = resolve()
        finally:
            with self._lock:
                self._resolving = False
        with self._lock:
            self._set(clients)

    def _done(self, addr: str) -> None:
        with self._lock:
            self._in_flight[addr] -= 1
