"""One decode replica as the router sees it (docs/DESIGN.md, "Router"): its channel, and two threads, one polling
its health and load, the other following its Events (blocks its node's store and its own KV pool named and
removed) into its Holdings; and its Ejection, which router.policy.Outliers decides.

Busy is not dead: a replica is left out when it says it does not serve or its connection is refused or reset,
not when a health check times out (until `dead_after_s` of them) or is refused as busy (a replica answers only
a few at once: a caller holding those must not take it out of service). What it says is checked
(protos.bounds): one that lies is distrusted, its claims dropped, and heard again after `distrust_s`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.router.index import INDEX_BYTES, Holdings
from kvserve.rpc.server import CLIENT_CHANNEL_OPTIONS
from kvserve.rpc.tls import TLSConfig, channel
from protos.bounds import Lie, check_event, check_load
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
from protos.retry import Backoff

log = logging.getLogger(__name__)

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
Metadata = Sequence[tuple[str, str]]
DISTRUST_S = 60.0  # how long a replica that lied goes unheard before its events are followed again
# A health check unanswered this long means a busy replica (its workers all taken), not a dead one: it keeps
# its place until its checks have gone unanswered for DEAD_AFTER_S (a hung or stopped process).
CHECK_TIMEOUT_S = 1.0
DEAD_AFTER_S = 30.0


class Ejection:
    """One replica's outlier state: its failures in a row, and until when it is out of choice."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._failures = 0  # requests that failed there in a row
        self._until: float | None = None  # out of choice until then, and then until its health says it serves
        self._ejections = 0  # what its next ejection's time is a multiple of, less what it served since its last
        self._readmitted = 0.0  # when it was last taken back
        self._lock = threading.Lock()

    @property
    def ejected(self) -> bool:
        return self._until is not None

    def served(self) -> None:
        """A stream there ended with its result: its run of failures is over."""
        self._failures = 0

    def failed(self) -> int:
        """A request failed there: the number in a row, now."""
        with self._lock:
            self._failures += 1
            return self._failures

    def eject(self, base_s: float, most_s: float) -> float:
        """Out of choice for `base_s` × its ejections (one fewer for each `base_s` it served since the last), at
        most `most_s`; the seconds, 0 when it is ejected already."""
        with self._lock:
            if self._until is not None:
                return 0.0
            now = self._clock()
            served = int((now - self._readmitted) / base_s) if self._ejections else 0
            self._ejections = max(0, self._ejections - served) + 1
            seconds = min(base_s * self._ejections, max(most_s, base_s))
            self._until = now + seconds
            self._failures = 0
        return seconds

    def readmit(self) -> float | None:
        """Back in choice if its time is over (its health check says it serves): how long ago it ended; None
        when it is not ejected or its time is not over."""
        with self._lock:
            now = self._clock()
            if self._until is None or now < self._until:
                return None
            until, self._until = self._until, None
            self._readmitted = now
        return now - until


class Replica:
    """One decode replica: its channel, whether it is healthy, how busy, and which blocks it holds."""

    def __init__(self, addr: str, tls: TLSConfig | None, metadata: Metadata, index_capacity: int,
                 poll_s: float, target_name: str | None = None, *, index_bytes: int = INDEX_BYTES,
                 distrust_s: float = DISTRUST_S, on_lie: Callable[[str, Lie], None] | None = None,
                 check_timeout_s: float = CHECK_TIMEOUT_S, dead_after_s: float = DEAD_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.addr = addr
        options: list[tuple[str, Any]] = list(CLIENT_CHANNEL_OPTIONS)
        if tls is not None and target_name is not None:  # an address resolved from a name: check the name
            options.append(("grpc.ssl_target_name_override", target_name))
        self._channel = channel(addr, options, tls)
        self.decode = decode_pb2_grpc.DecodeStub(self._channel)
        self.replica = decode_pb2_grpc.DecodeReplicaStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = list(metadata)
        self.blocks = Holdings(index_capacity, index_bytes // 2)  # its store's and its pool's, half each
        self.ejection = Ejection(clock)
        self.healthy = False
        self.others_load = 0  # sequences there that are not this router's, when it last asked
        self.in_flight = 0  # requests this router has sent there and not seen end
        self.last_chosen = 0  # the policy's number of the last request placed here
        self._lock = threading.Lock()
        self._poll_s = poll_s
        self._check_timeout_s = max(check_timeout_s, poll_s)
        self._dead_after_s = dead_after_s
        self._clock = clock  # for its health's and its ejections' times
        self._silent_since: float | None = None  # when the current run of unanswered health checks began
        self._distrust_s = distrust_s
        self._on_lie = on_lie
        self._stop = threading.Event()
        self._events_call: Any = None
        self._threads = [threading.Thread(target=self._poll, name=f"poll {addr}", daemon=True),
                         threading.Thread(target=self._follow_events, name=f"events {addr}", daemon=True)]

    @property
    def serving(self) -> bool:
        """Requests go there: its health check says it serves and it is not ejected for failing requests."""
        return self.healthy and not self.ejection.ejected

    @property
    def load(self) -> int:
        """Sequences running or waiting there: this router's own, counted as they start and end, and the
        others' (other routers', direct callers') as of the last poll, unless the replica lied."""
        return self.in_flight + (self.others_load if self.blocks.trusted else 0)

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        if self._events_call is not None:
            self._events_call.cancel()
        self._channel.close()

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def ended(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def mark_down(self) -> None:
        self.healthy = False

    def distrust(self, lie: Lie) -> None:
        """Drops all the replica claimed, once it lied: its Events stream is cancelled, its indexes cleared
        and its load taken as this router's own requests there. Requests still go there (it may be healthy,
        and only its Generate answers reach callers); its claims steer none. Its events are followed
        again, from an empty index, after `distrust_s`."""
        if not self.blocks.distrust(lie):
            return
        self.others_load = 0
        call = self._events_call
        if call is not None:
            call.cancel()
        log.warning("decode replica %s lied (%s: %s): its blocks and load are not believed; following its "
                    "events again in %.0f s", self.addr, lie.reason, str(lie), self._distrust_s)
        if self._on_lie is not None:
            self._on_lie(self.addr, lie)

    def _check(self) -> bool | None:
        """True when the replica says it serves; False when it says it does not (draining, not loaded) or its
        connection is refused or reset; None when it did not answer in time; the verdict it had when it refuses
        the check as busy (its few health checks at once taken: it answers, so it is not dead)."""
        try:
            status = self._health.Check(health_pb2.HealthCheckRequest(service=DECODE_SERVICE),
                                        timeout=self._check_timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return self.healthy
            return None if code == grpc.StatusCode.DEADLINE_EXCEEDED else False
        except ValueError:  # the channel was closed
            return False
        return status.status == health_pb2.HealthCheckResponse.SERVING

    def _poll(self) -> None:
        warned = False
        while not self._stop.is_set():
            healthy = self._check()
            if healthy is None:  # busy, not dead: its verdict and its load stay as last known, for a while
                self._silent()
                self._stop.wait(self._poll_s)
                continue
            self._silent_since = None
            if healthy:
                warned = self._poll_load(warned)
            if healthy != self.healthy:
                log.info("decode replica %s is %s", self.addr, "healthy" if healthy else "unhealthy")
            self.healthy = healthy
            if healthy and (ended_s := self.ejection.readmit()) is not None:
                log.info("decode replica %s is back in choice: its ejection ended %.1f s ago and its health check "
                         "says it serves", self.addr, ended_s)
            self._stop.wait(self._poll_s)

    def _silent(self) -> None:
        """A health check went unanswered: the replica is taken as dead once they have for `dead_after_s`."""
        now = self._clock()
        if self._silent_since is None:
            self._silent_since = now
        if self.healthy and now - self._silent_since >= self._dead_after_s:
            log.warning("decode replica %s has answered no health check for %.0f s (hung or stopped): "
                        "taking it as dead", self.addr, now - self._silent_since)
            self.healthy = False

    def _poll_load(self, warned: bool) -> bool:
        """Asks its load; the load stays as last known when it does not say (requests still go there). True once
        the missing token has been warned of."""
        try:
            mine = self.in_flight
            reply = self.replica.Load(decode_pb2.LoadRequest(), timeout=self._check_timeout_s,
                                      metadata=self._metadata)
            self.others_load = max(0, check_load(reply) - mine)
        except Lie as lie:
            self.distrust(lie)
        except (grpc.RpcError, ValueError) as exc:
            if not warned and isinstance(exc, grpc.Call) and exc.code() in (
                    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED):
                log.warning("decode replica %s does not tell its load (%s): give the router --token "
                            "when the replicas require one", self.addr, exc.details())
                return True
        return warned

    def _follow_events(self) -> None:
        # one that keeps ending soon after it began is followed again later and later, not every half second
        # with its snapshot sent each time
        backoff = Backoff(initial_s=0.5, max_s=5.0, stable_s=5.0)
        while not self._stop.is_set():
            if not self.blocks.trusted:  # it lied: nothing it said is kept, and it is heard again after a while
                if self._stop.wait(self._distrust_s):
                    return
                self.blocks.trust_again()
            opened = time.monotonic()
            try:
                self._events_call = call = self.replica.Events(kvstore_pb2.EventsRequest(), metadata=self._metadata)
                first = True  # the stream starts with a snapshot of the pool: what was known before goes then
                for event in call:
                    check_event(event)
                    if not self.blocks.apply(event, snapshot=first):  # it lied elsewhere (its load, a prompt's hashes)
                        call.cancel()
                        break
                    first = first and event.tier != kvstore_pb2.TIER_ENGINE
            except Lie as lie:
                self.distrust(lie)
                continue
            except (grpc.RpcError, ValueError) as exc:
                if self._stop.is_set():
                    return
                code = exc.code().name if isinstance(exc, grpc.Call) else str(exc)
                log.debug("events of %s ended (%s); following again", self.addr, code)
            self._stop.wait(backoff.delay(time.monotonic() - opened))
