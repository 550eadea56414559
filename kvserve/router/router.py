"""Placing requests on decode replicas (docs/DESIGN.md, "Router").

Each replica is watched by two threads: one polls its health and load, the other follows its
Events (blocks its node's store and its own KV pool named and removed) into two indexes of the
block hashes it holds. A request goes to the healthy replica with the lowest cost:

- `prefix`: blocks left to compute (the prompt's full blocks past the leading ones the replica
  holds, in its pool or its node's store) + `load_weight` × its sequences (running and waiting),
  so a prefix pulls a request to the replica that has it until that replica is that much busier
  than the others; a chat's next turn goes where its history is, which computes only the new
  question (decode's --local-prefill-tokens);
- `least-loaded`: its sequences;
- `round-robin`: in turn.

The prompt's block hashes come from one replica (`DecodeReplica.PrefixHashes`), which tokenizes and
scopes them to the caller's tenant exactly as the replica serving the request will; a router holds
no model and no tenant secret. A replica's index also learns a request's blocks when the router
sends it there, before its store says so, so that a burst of turns of one chat stays together.

What a replica says is checked (protos.bounds) and its indexes are capped in bytes: a replica that
lies is distrusted, its claims dropped, so that it can neither steer placement nor grow this process.

Busy is not dead: a replica is left out when it says it does not serve or its connection is refused or
reset, not when a health check times out (until DEAD_AFTER_S of them) or is refused as busy (a replica
answers only a few at once: a caller holding those must not take it out of service), nor when it refuses a
request as busy (the next replica is asked, then all again after a backoff). A stream whose replica dies after its
first token goes on from another replica, which resumes after the tokens the caller has.

Accepting is not answering: a replica that sends no first response within `first_token_timeout_s` has its call
cancelled and the request goes to another (nothing reached the caller yet). A replica that fails `eject_after`
requests in a row (no first response in time, UNAVAILABLE, a stream ended without a result) is ejected from
choice, as in Envoy's outlier detection, for longer each time, and taken back once that time is over and its
health check says it serves; never the last replica serving.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.rpc.addresses import Targets
from kvserve.rpc.auth import ON_BEHALF_OF
from kvserve.rpc.errors import ResourceExhausted, ServiceError, Unavailable
from kvserve.rpc.server import CLIENT_CHANNEL_OPTIONS
from kvserve.rpc.tls import TLSConfig, channel
from protos.block_hash import BlockHash
from protos.bounds import Lie, check_event, check_load, prompt_hashes
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
from protos.retry import Backoff, retry_after_s

log = logging.getLogger(__name__)

POLICIES = ("prefix", "least-loaded", "round-robin")
DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
Metadata = Sequence[tuple[str, str]]
# What one entry of a BlockIndex costs past its hash's own bytes: the hash's bytes object (33 bytes of
# header, 80 in all with pymalloc's rounding for a 32-byte hash) and its dict slot (37-60 bytes measured
# between resizes, CPython 3.11), rounded up.
ENTRY_BYTES = 128
# A replica's two indexes together (half each): 419,430 blocks an index at 32 + 128 bytes, 6.7 M tokens
# at 16 a block, more than an 8B model's KV pool on an H200 (~50 k blocks); 8 replicas cost 1 GiB at most,
# whatever they send.
INDEX_BYTES = 128 << 20
DISTRUST_S = 60.0  # how long a replica that lied goes unheard before its events are followed again
# A health check unanswered this long means a busy replica (its workers all taken), not a dead one: it keeps
# its place until its checks have gone unanswered for DEAD_AFTER_S (a hung or stopped process).
CHECK_TIMEOUT_S = 1.0
DEAD_AFTER_S = 30.0
# A replica refusing a request with a retry hint (protos.retry) is only busy; without, it will refuse it again.
BUSY_ROUNDS = 3  # times the busy replicas are asked for a request they all refuse, before it is refused
BACKOFF_S = 0.05  # the wait between two such rounds (with full jitter) grows from this, doubling
MAX_BACKOFF_S = 2.0  # the longest wait between two rounds, whatever a replica hints
MAX_MIGRATIONS = 3  # times one request's stream is moved to another replica after its replica died
# A first response later than this means a replica that accepted the request and will not answer (hung), not a
# long prompt: 1.7x the slowest first token measured under load (17.9 s, a 10-round chat of 4 users on CPU with
# no cache, BENCHMARKS.md), and half the 60 s deadline callers give, leaving the other half to the next replica.
FIRST_TOKEN_TIMEOUT_S = 30.0
# Outlier ejection, Envoy's defaults but for the count: each failure costs its caller up to FIRST_TOKEN_TIMEOUT_S,
# and a busy replica that works ends some streams between its slow ones, which starts the count again.
EJECT_AFTER = 3  # failures in a row that eject a replica
EJECTION_S = 30.0  # how long its first ejection lasts; the n-th, n times that (less one per EJECTION_S served since)
MAX_EJECTION_S = 300.0


class Upstream(ServiceError):
    """A replica's own status, passed on to the caller as it came."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Progress:
    """What has become of one request so far."""

    sent: array[int] = field(default_factory=lambda: array("I"))  # token ids passed on to the caller, 4 bytes each
    down: dict[str, str] = field(default_factory=dict)  # replica -> how it failed it (not asked again)
    busy: dict[str, str] = field(default_factory=dict)  # replica -> its message: refused as busy this round
    full: dict[str, str] = field(default_factory=dict)  # replica -> its message: refused for good (no hint)
    hint_s: float = 0.0  # the longest retry hint among this round's refusals
    rounds: int = 0  # rounds in which every replica refused it
    moves: int = 0  # times its stream was moved to another replica
    moving: bool = False  # moved, and no replica has answered since


class FirstTokenWatch:
    """Cancels a call whose first response has not come within `timeout_s`; `expired` then says the router, not
    the caller, cancelled it."""

    def __init__(self, call: Any, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.expired = False
        self._call = call
        self._answered = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def answered(self) -> bool:
        """The first response came: True, and the watch ends, unless the call was cancelled already."""
        with self._lock:
            self._answered = not self.expired
        self._timer.cancel()
        return self._answered

    def stop(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            if self._answered:
                return
            self.expired = True
            self._call.cancel()


class BlockIndex:
    """The block hashes one replica's node holds, oldest first: at most `capacity` of them and `capacity_bytes`
    (`nbytes`: each hash's length + ENTRY_BYTES), the oldest forgotten."""

    def __init__(self, capacity: int, capacity_bytes: int = INDEX_BYTES // 2) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._blocks: dict[BlockHash, None] = {}
        self._lock = threading.Lock()

    def add(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._blocks:
                    del self._blocks[BlockHash(h)]  # seen again: now the newest
                else:
                    self.nbytes += len(h) + ENTRY_BYTES
                self._blocks[BlockHash(h)] = None
            while self._blocks and (len(self._blocks) > self.capacity or self.nbytes > self.capacity_bytes):
                oldest = next(iter(self._blocks))
                del self._blocks[oldest]
                self.nbytes -= len(oldest) + ENTRY_BYTES

    def remove(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._blocks:
                    del self._blocks[BlockHash(h)]
                    self.nbytes -= len(h) + ENTRY_BYTES

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)


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
        self.index = BlockIndex(index_capacity, index_bytes // 2)  # in its node's store
        self.pool = BlockIndex(index_capacity, index_bytes // 2)  # in its engine's KV pool
        self._pool_bounds = (index_capacity, index_bytes // 2)
        self.lie: Lie | None = None  # why its claims are not believed, until its events are followed again
        self.healthy = False
        self.others_load = 0  # sequences there that are not this router's, when it last asked
        self.in_flight = 0  # requests this router has sent there and not seen end
        self.last_chosen = 0  # the router's number of the last request placed here
        self._lock = threading.Lock()
        self._poll_s = poll_s
        self._check_timeout_s = max(check_timeout_s, poll_s)
        self._dead_after_s = dead_after_s
        self._clock = clock  # for its health's and its ejections' times
        self._silent_since: float | None = None  # when the current run of unanswered health checks began
        self._failures = 0  # requests that failed there in a row
        self._ejected_until: float | None = None  # out of choice until then, and then until its health says it serves
        self._ejections = 0  # what its next ejection's time is a multiple of, less what it served since its last
        self._readmitted = 0.0  # when it was last taken back
        self._distrust_s = distrust_s
        self._on_lie = on_lie
        self._stop = threading.Event()
        self._events_call: Any = None
        self._threads = [threading.Thread(target=self._poll, name=f"poll {addr}", daemon=True),
                         threading.Thread(target=self._follow_events, name=f"events {addr}", daemon=True)]

    @property
    def trusted(self) -> bool:
        return self.lie is None

    @property
    def ejected(self) -> bool:
        return self._ejected_until is not None

    @property
    def serving(self) -> bool:
        """Requests go there: its health check says it serves and it is not ejected for failing requests."""
        return self.healthy and self._ejected_until is None

    @property
    def load(self) -> int:
        """Sequences running or waiting there: this router's own, counted as they start and end, and the
        others' (other routers', direct callers') as of the last poll, unless the replica lied."""
        return self.in_flight + (self.others_load if self.lie is None else 0)

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading `hashes` the replica holds, in its pool or its node's store; 0 when it lied."""
        if self.lie is not None:
            return 0
        n = 0
        for h in hashes:
            if h not in self.pool and h not in self.index:
                break
            n += 1
        return n

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

    def served(self) -> None:
        """A stream there ended with its result: its run of failures is over."""
        self._failures = 0

    def failed(self) -> int:
        """A request failed there (Router._failed says how): the number in a row, now."""
        with self._lock:
            self._failures += 1
            return self._failures

    def eject(self, base_s: float, most_s: float) -> float:
        """Takes it out of choice for `base_s` × its ejections (one fewer for each `base_s` it served since the
        last), at most `most_s`; the seconds, 0 when it is ejected already."""
        with self._lock:
            if self._ejected_until is not None:
                return 0.0
            now = self._clock()
            served = int((now - self._readmitted) / base_s) if self._ejections else 0
            self._ejections = max(0, self._ejections - served) + 1
            seconds = min(base_s * self._ejections, max(most_s, base_s))
            self._ejected_until = now + seconds
            self._failures = 0
        return seconds

    def _readmit(self) -> None:
        """Its ejection is over and its health check says it serves: back in choice."""
        with self._lock:
            until, self._ejected_until = self._ejected_until, None
            self._readmitted = self._clock()
        if until is not None:
            log.info("decode replica %s is back in choice: its ejection ended %.1f s ago and its health check says "
                     "it serves", self.addr, self._readmitted - until)

    def learned(self, hashes: Sequence[BlockHash]) -> None:
        """A request whose prompt has `hashes` was sent there: the replica will hold its blocks."""
        with self._lock:
            if self.lie is None:
                self.index.add(hashes)

    def distrust(self, lie: Lie) -> None:
        """Drops all the replica claimed, once it lied: its Events stream is cancelled, its indexes cleared
        and its load taken as this router's own requests there. Requests still go there (it may be healthy,
        and only its Generate answers reach callers); its claims steer none. Its events are followed
        again, from an empty index, after `distrust_s`."""
        with self._lock:  # what it claimed is added under this lock too: none of it outlives the lie
            if self.lie is not None:
                return
            self.lie = lie.with_traceback(None)  # whose frames hold the message that lied
            self.index.clear()
            self.pool.clear()
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
                now = self._clock()
                if self._silent_since is None:
                    self._silent_since = now
                if self.healthy and now - self._silent_since >= self._dead_after_s:
                    log.warning("decode replica %s has answered no health check for %.0f s (hung or stopped): "
                                "taking it as dead", self.addr, now - self._silent_since)
                    self.healthy = False
                self._stop.wait(self._poll_s)
                continue
            self._silent_since = None
            if healthy:
                try:
                    mine = self.in_flight
                    reply = self.replica.Load(decode_pb2.LoadRequest(), timeout=self._check_timeout_s,
                                              metadata=self._metadata)
                    self.others_load = max(0, check_load(reply) - mine)
                except Lie as lie:
                    self.distrust(lie)
                except (grpc.RpcError, ValueError) as exc:  # the load stays as last known; requests still go there
                    if not warned and isinstance(exc, grpc.Call) and exc.code() in (
                            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED):
                        log.warning("decode replica %s does not tell its load (%s): give the router --token "
                                    "when the replicas require one", self.addr, exc.details())
                        warned = True
            if healthy != self.healthy:
                log.info("decode replica %s is %s", self.addr, "healthy" if healthy else "unhealthy")
            self.healthy = healthy
            until = self._ejected_until
            if healthy and until is not None and self._clock() >= until:
                self._readmit()
            self._stop.wait(self._poll_s)

    def _apply(self, event: kvstore_pb2.Event, snapshot: bool = False) -> bool:
        """Adds or removes what a checked event names; False (nothing done) once the replica has lied. The
        first event of a stream (`snapshot`) begins its pool anew: the new index takes the old one's place
        once it holds that event's hashes, so the pool never looks empty in between."""
        index = self.pool if event.tier == kvstore_pb2.TIER_ENGINE else self.index
        with self._lock:
            if self.lie is not None:
                return False
            if snapshot and event.tier == kvstore_pb2.TIER_ENGINE:
                fresh = BlockIndex(*self._pool_bounds)
                if event.kind == kvstore_pb2.Event.KIND_STORED:
                    fresh.add(event.hashes)
                self.pool = fresh
            elif event.kind == kvstore_pb2.Event.KIND_STORED:
                index.add(event.hashes)
            else:
                index.remove(event.hashes)
        return True

    def _follow_events(self) -> None:
        backoff = Backoff(initial_s=0.5, max_s=5.0, stable_s=5.0)
        while not self._stop.is_set():
            if self.lie is not None:  # it lied: nothing it said is kept, and it is heard again after a while
                if self._stop.wait(self._distrust_s):
                    return
                with self._lock:
                    self.index.clear()
                    self.pool.clear()
                    self.lie = None
            opened = time.monotonic()
            try:
                self._events_call = call = self.replica.Events(kvstore_pb2.EventsRequest(), metadata=self._metadata)
                first = True  # the stream starts with a snapshot of the pool: what was known before goes then
                for event in call:
                    check_event(event)
                    if not self._apply(event, snapshot=first):  # it lied elsewhere (its load, a prompt's hashes)
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
            # one that keeps ending soon after it began is followed again later and later, not every half second
            # with its snapshot sent each time
            self._stop.wait(backoff.delay(time.monotonic() - opened))


class Router:
    def __init__(self, targets: Sequence[str], *, policy: str = "prefix", load_weight: float = 32.0,
                 tls: TLSConfig | None = None, metadata: Metadata = (), index_capacity: int = 1_000_000,
                 index_bytes: int = INDEX_BYTES, distrust_s: float = DISTRUST_S,
                 poll_s: float = 0.5, resolve_every_s: float = 10.0,
                 check_timeout_s: float = CHECK_TIMEOUT_S, dead_after_s: float = DEAD_AFTER_S,
                 busy_rounds: int = BUSY_ROUNDS, max_migrations: int = MAX_MIGRATIONS,
                 first_token_timeout_s: float = FIRST_TOKEN_TIMEOUT_S, eject_after: int = EJECT_AFTER,
                 ejection_s: float = EJECTION_S, max_ejection_s: float = MAX_EJECTION_S,
                 on_route: Callable[[str, str, int], None] | None = None) -> None:
        """`index_capacity` and `index_bytes` cap what the router keeps of each replica's blocks (entries in
        each of its two indexes, bytes in both); `distrust_s`: how long a replica that lied goes unheard;
        `dead_after_s`: how long a replica that answers no health check keeps its place; `busy_rounds`,
        `max_migrations` and `first_token_timeout_s` (0: none): see `generate`; `eject_after` (0: never),
        `ejection_s` and `max_ejection_s`: see `_failed`."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
        if not targets:
            raise ValueError("at least one decode replica address is needed")
        if first_token_timeout_s < 0 or eject_after < 0 or ejection_s <= 0:
            raise ValueError(f"first_token_timeout_s ({first_token_timeout_s}) and eject_after ({eject_after}) must "
                             f"be at least 0, ejection_s ({ejection_s}) more than 0")
        self.targets = list(targets)
        self._targets = Targets(self.targets)
        self._leaving: dict[str, Replica] = {}  # gone from the names' addresses, streams still open on them
        self.policy = policy
        self.load_weight = load_weight
        self._tls = tls
        self._metadata = list(metadata)
        self._index_capacity = index_capacity
        self._index_bytes = index_bytes
        self._distrust_s = distrust_s
        self._poll_s = poll_s
        self._resolve_every_s = resolve_every_s
        self._check_timeout_s = check_timeout_s
        self._dead_after_s = dead_after_s
        self.busy_rounds = busy_rounds
        self.max_migrations = max_migrations
        self.first_token_timeout_s = first_token_timeout_s
        self.eject_after = eject_after
        self.ejection_s = ejection_s
        self.max_ejection_s = max_ejection_s
        self._random = random.Random()  # the backoffs' jitter
        self._timeouts: Counter[str] = Counter()  # replica: calls cancelled for want of a first response in time
        self._ejections: Counter[str] = Counter()  # replica: times it was ejected
        self._ejecting = threading.Lock()  # one ejection at a time: never the last replica serving
        self._refusals: Counter[str] = Counter()  # replica: requests it refused as busy
        self._migrations: Counter[str] = Counter()  # outcome: streams moved (resumed), or not (limit, failed)
        self._overloaded = 0  # requests refused as busy, every replica having refused them
        self.on_route = on_route  # (replica, policy, leading blocks it held) of each request placed
        self.replicas: dict[str, Replica] = {}
        self._lies: Counter[tuple[str, str]] = Counter()  # (replica, reason): times it was distrusted
        self._lock = threading.Lock()
        self._choices = itertools.count(1)  # numbers each choice: among equals, the least recently chosen goes
        self._hash_turn = itertools.count()  # which replica prefix_hashes asks
        self._stop = threading.Event()
        self._started = False
        self._resolve()
        self._resolver = threading.Thread(target=self._keep_resolving, name="resolve", daemon=True)

    def start(self) -> None:
        """Starts watching the replicas (health, load, events) and resolving their names again."""
        self._started = True
        for r in self._all():
            r.start()
        self._resolver.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            replicas, self.replicas = [*self.replicas.values(), *self._leaving.values()], {}
            self._leaving = {}
        for r in replicas:
            r.close()

    @property
    def num_healthy(self) -> int:
        return sum(r.healthy for r in self._all())

    @property
    def num_distrusted(self) -> int:
        return sum(not r.trusted for r in self._all())

    @property
    def num_ejected(self) -> int:
        return sum(r.ejected for r in self._all())

    @property
    def index_bytes(self) -> int:
        """What the replicas' indexes hold now, in bytes (BlockIndex.nbytes)."""
        return sum(r.index.nbytes + r.pool.nbytes for r in self._all())

    def lies(self) -> dict[tuple[str, str], int]:
        """(replica, reason): how many times a replica was distrusted, for every reason it was."""
        with self._lock:
            return dict(self._lies)

    def _lied(self, addr: str, lie: Lie) -> None:
        with self._lock:
            self._lies[addr, lie.reason] += 1

    def refusals(self) -> dict[str, int]:
        """Replica: how many requests it refused as busy (RESOURCE_EXHAUSTED before its first response)."""
        with self._lock:
            return dict(self._refusals)

    def migrations(self) -> dict[str, int]:
        """How many streams whose replica died were moved, by outcome: `resumed` (another replica took the
        stream up), `limit` (moved --max-migrations times already: the caller got the failure), `failed` (no
        replica took it up: the caller got why)."""
        with self._lock:
            return dict(self._migrations)

    def first_token_timeouts(self) -> dict[str, int]:
        """Replica: how many calls the router cancelled there for want of a first response in time."""
        with self._lock:
            return dict(self._timeouts)

    def ejections(self) -> dict[str, int]:
        """Replica: how many times it was ejected for failing requests in a row."""
        with self._lock:
            return dict(self._ejections)

    @property
    def overloaded(self) -> int:
        """Requests refused as busy (RESOURCE_EXHAUSTED) after every replica refused them."""
        return self._overloaded

    def _count(self, counter: Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    # -- placing a request ---------------------------------------------------------------------

    def prefix_hashes(self, request: decode_pb2.GenerateRequest, metadata: Metadata,
                      timeout_s: float) -> list[BlockHash]:
        """The prompt's block hashes from a healthy replica (the two asked at most, within `timeout_s` in all), asked with the router's own service token and,
        in `ON_BEHALF_OF`, the caller's (so that they are its tenant's); [] when none answers (the request
        is then placed by load alone, as when they are busy). A status about the request itself (a bad
        prompt) is the caller's, raised as it came; a refused token is placed by load too (the Generate call then says why, or the
        router's token is wrong: logged)."""
        asked = [*self._metadata, *((ON_BEHALF_OF, v) for k, v in metadata if k == "authorization")]
        deadline = time.monotonic() + timeout_s  # for both replicas asked together
        for replica in [r for r in self._healthy(self._hash_turn) if r.trusted][:2]:
            try:
                reply = replica.replica.PrefixHashes(request, metadata=asked,
                                                     timeout=max(0.0, deadline - time.monotonic()))
                return prompt_hashes(reply)
            except Lie as lie:
                replica.distrust(lie)
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    log.warning("prefix hashes from %s refused (%s: %s): placing by load; the router's "
                                "--token-file must be a token from the replicas' --service-tokens",
                                replica.addr, code.name, details)
                    return []
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy (its calls at their limit): not the caller's
                    log.debug("prefix hashes from %s refused as busy (%s): asking another", replica.addr, details)
                    continue
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNIMPLEMENTED):
                    raise Upstream(code, details) from exc
                log.warning("prefix hashes from %s failed (%s): placing by load", replica.addr, code.name)
        return []

    def choose(self, hashes: Sequence[BlockHash], avoid: Sequence[str] = ()) -> tuple[Replica, int] | None:
        """The replica to send a request to and how many of its leading blocks it holds; None when no
        replica outside `avoid` serves (healthy and not ejected)."""
        candidates = [r for r in self._all() if r.serving and r.addr not in avoid]
        if not candidates:
            return None
        held = {r.addr: r.leading(hashes) for r in candidates}

        def cost(r: Replica) -> float:
            if self.policy == "prefix":
                return (len(hashes) - held[r.addr]) + self.load_weight * r.load
            return r.load if self.policy == "least-loaded" else 0

        best = min(candidates, key=lambda r: (cost(r), r.last_chosen))
        best.last_chosen = next(self._choices)
        return best, held[best.addr]

    def generate(self, request: decode_pb2.GenerateRequest, metadata: Metadata,
                 time_left: Callable[[], float | None],
                 on_call: Callable[[Any], None]) -> Iterator[decode_pb2.GenerateResponse]:
        """Streams the answer from the chosen replica, as one stream whatever befalls the replicas.

        Before a replica's first response: one that fails (UNAVAILABLE: it died, it is draining) is marked
        down and another tried; one that refuses the request as busy (RESOURCE_EXHAUSTED) is passed over for
        the next, and once every replica has refused it they are asked again after a backoff, `busy_rounds`
        times in all, within the caller's deadline; then ResourceExhausted with a retry hint (`_place`).
        After its first response: a stream that fails with UNAVAILABLE or ends without a result moves to
        another replica, which resumes after the tokens the caller has (resume_token_ids), at most
        `max_migrations` times a request. A replica whose first response has not come within
        `first_token_timeout_s` (when the caller's deadline is later and another replica could take the request)
        is cancelled and the request goes to another. Any other status is the caller's, as the replica gave it.
        `on_call` receives each upstream call (to cancel it)."""
        hashes = (self.prefix_hashes(request, metadata, _bounded(time_left(), 5.0))
                  if self.policy == "prefix" else [])
        progress = _Progress()
        try:
            yield from self._stream(request, hashes, metadata, time_left, on_call, progress)
        except ServiceError:
            if progress.moving:
                self._count(self._migrations, "failed")
            raise

    def _stream(self, request: decode_pb2.GenerateRequest, hashes: Sequence[BlockHash], metadata: Metadata,
                time_left: Callable[[], float | None], on_call: Callable[[Any], None],
                p: _Progress) -> Iterator[decode_pb2.GenerateResponse]:
        while True:
            replica, held = self._place(hashes, p, time_left)
            upstream = request
            if p.sent:  # a moved stream: the replica continues after what the caller has
                upstream = decode_pb2.GenerateRequest()
                upstream.CopyFrom(request)
                upstream.resume_token_ids.extend(p.sent)
            call = replica.decode.Generate(upstream, metadata=metadata, timeout=time_left())
            on_call(call)
            watch = self._watch(call, replica, p, time_left)
            replica.started()
            answered = finished = False
            try:
                for response in call:
                    if not answered:
                        if watch is not None and not watch.answered():
                            continue  # it came as the router cancelled the call: the stream ends CANCELLED
                        answered = True
                        replica.learned(hashes)  # it will hold them: the next turn should find them here
                        if self.on_route is not None:
                            self.on_route(replica.addr, self.policy, held)
                        if p.moving:
                            self._count(self._migrations, "resumed")
                            p.moving = False
                    if response.WhichOneof("kind") == "token":
                        p.sent.append(response.token.token_id)
                    else:
                        finished = True
                        replica.served()
                    yield response
                if finished:
                    return
                if watch is not None and watch.expired:
                    self._late(replica, p, watch)
                    continue
                if not answered:
                    self._failed(replica, "it ended its stream without an answer")
                    raise Upstream(grpc.StatusCode.INTERNAL, f"decode replica {replica.addr} ended without an answer")
                failure = "its stream ended without a result"
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
                details = (exc.details() if isinstance(exc, grpc.Call) else str(exc)) or code.name
                if code == grpc.StatusCode.CANCELLED and watch is not None and watch.expired:  # not the caller
                    self._late(replica, p, watch)
                    continue
                if not answered and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._count(self._refusals, replica.addr)
                    hint_s = retry_after_s(exc)
                    if hint_s is None:
                        p.full[replica.addr] = details
                    else:
                        p.busy[replica.addr] = details
                        p.hint_s = max(p.hint_s, hint_s)
                    continue
                if finished:  # the caller has its whole answer: how the call ended after it changes nothing
                    return
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise Upstream(code, details) from exc
                if not answered:
                    log.warning("decode replica %s failed before the first token (%s): trying another",
                                replica.addr, details)
                    replica.mark_down()
                    p.down[replica.addr] = details
                    self._failed(replica, details)
                    continue
                failure = details
            finally:
                if watch is not None:
                    watch.stop()
                replica.ended()
            self._move(replica, p, failure)

    def _watch(self, call: Any, replica: Replica, p: _Progress,
               time_left: Callable[[], float | None]) -> FirstTokenWatch | None:
        """A watch that cancels `call` unless its first response comes within `first_token_timeout_s`; None when
        the caller's deadline comes first (the call's own deadline ends it) or no other replica could take the
        request (a slow first token is then better than none)."""
        timeout_s = self.first_token_timeout_s
        left = time_left()
        if timeout_s <= 0 or (left is not None and left <= timeout_s):
            return None
        tried = {*p.down, *p.full, *p.busy, replica.addr}
        if not any(r.serving and r.addr not in tried for r in self._all()):
            return None
        return FirstTokenWatch(call, timeout_s)

    def _late(self, replica: Replica, p: _Progress, watch: FirstTokenWatch) -> None:
        """`replica` sent no first response within the watch's time, and its call was cancelled: the request goes
        to another replica, and the replica counts a failure (it is not marked down: its health says so or not)."""
        why = f"no first response within {watch.timeout_s:g} s (--first-token-timeout-s)"
        log.warning("decode replica %s sent %s: cancelled, trying another", replica.addr, why)
        self._count(self._timeouts, replica.addr)
        p.down[replica.addr] = why
        self._failed(replica, why)

    def _failed(self, replica: Replica, why: str) -> None:
        """`replica` failed a request (`why`): no first response in time, UNAVAILABLE, a stream ended without a
        result. At `eject_after` failures in a row it is ejected from choice (`Replica.eject`: `ejection_s` the
        first time, n times that the n-th, at most `max_ejection_s`) until that time is over and its health check
        says it serves, unless no other replica would be left serving: a slow answer is better than none."""
        n = replica.failed()
        if self.eject_after == 0 or n < self.eject_after:
            return
        with self._ejecting:
            if replica.ejected:
                return
            if not any(r.serving for r in self._all() if r is not replica):
                if n == self.eject_after:
                    log.warning("decode replica %s failed %d requests in a row (the last: %s); not ejected: no "
                                "other replica serves", replica.addr, n, why)
                return
            seconds = replica.eject(self.ejection_s, self.max_ejection_s)
        self._count(self._ejections, replica.addr)
        log.warning("decode replica %s failed %d requests in a row (the last: %s): ejected for %.0f s, then taken "
                    "back once its health check says it serves", replica.addr, n, why, seconds)

    def _move(self, replica: Replica, p: _Progress, failure: str) -> None:
        """The stream from `replica` broke after tokens reached the caller: it goes to another replica, unless
        it has moved `max_migrations` times already."""
        replica.mark_down()
        p.down[replica.addr] = failure
        self._failed(replica, failure)
        if p.moves >= self.max_migrations:
            self._count(self._migrations, "limit")
            raise Upstream(grpc.StatusCode.UNAVAILABLE, f"decode replica {replica.addr} failed after {len(p.sent)} "
                           f"tokens ({failure}); this stream moved {p.moves} times already, the most "
                           "--max-migrations allows")
        p.moves += 1
        p.moving = True
        log.warning("decode replica %s failed after %d tokens (%s): moving the stream to another replica "
                    "(migration %d of at most %d)", replica.addr, len(p.sent), failure, p.moves, self.max_migrations)

    def _place(self, hashes: Sequence[BlockHash], p: _Progress,
               time_left: Callable[[], float | None]) -> tuple[Replica, int]:
        """The replica to send the request to next and the leading blocks it holds: the best healthy one that
        has not failed the request, refused it for good, or refused it as busy in this round. Once every
        healthy replica has refused it, those that were busy are asked again after a backoff; ResourceExhausted
        with a retry hint after `busy_rounds` rounds, or sooner when the backoff would outlast the caller's
        deadline, and without one when none was busy, only refusing; Unavailable when no replica is healthy."""
        while True:
            chosen = self.choose(hashes, [*p.down, *p.full, *p.busy])
            if chosen is not None:
                return chosen
            if not p.busy and p.full:
                raise ResourceExhausted(f"the decode replicas refused it ({_refusals(p.full)})")
            if not p.busy:
                why = f" (failed: {_refusals(p.down)})" if p.down else ""
                raise Unavailable(f"no healthy decode replica among {', '.join(self.targets)}{why}; "
                                  "check `kvserve health` on each")
            p.rounds += 1
            wait = self._backoff(p)
            left = time_left()
            if p.rounds >= self.busy_rounds or (left is not None and wait >= left):
                with self._lock:
                    self._overloaded += 1
                retry_s = p.hint_s or self._ceiling(p.rounds + 1)
                raise ResourceExhausted(f"every decode replica is busy ({_refusals({**p.busy, **p.full})}), asked "
                                        f"{p.rounds} times; retry after {retry_s * 1000:.0f} ms", retry_after_s=retry_s)
            time.sleep(wait)
            p.busy.clear()
            p.hint_s = 0.0

    def _backoff(self, p: _Progress) -> float:
        """Seconds to wait before asking the busy replicas again: full jitter under a ceiling doubling from
        BACKOFF_S, and at least the longest wait a replica hinted (capped), so that refused callers neither
        come back all at once nor before they were asked to."""
        return min(MAX_BACKOFF_S, p.hint_s + self._random.uniform(0, self._ceiling(p.rounds)))

    @staticmethod
    def _ceiling(rounds: int) -> float:
        return min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (rounds - 1))

    # -- replicas ------------------------------------------------------------------------------

    def _all(self) -> list[Replica]:
        with self._lock:
            return list(self.replicas.values())

    def _healthy(self, turn: itertools.count[int]) -> list[Replica]:
        """Serving replicas (healthy, not ejected), starting at the next one in `turn`."""
        up = [r for r in self._all() if r.serving]
        if not up:
            return []
        k = next(turn) % len(up)
        return up[k:] + up[:k]

    def _resolve(self) -> None:
        """The replicas the names resolve to now. One gone from them (scaled down, or not ready for a moment) gets
        no new request, and its channel closes once the streams on it have ended (closing it would end them
        CANCELLED, a working replica's streams failed); one back in the meantime is taken back as it is."""
        wanted = self._targets.resolve()
        with self._lock:
            gone = [r for a, r in self.replicas.items() if a not in wanted]
            back = {a: r for a, r in self._leaving.items() if a in wanted}
            new = {a: Replica(a, self._tls, self._metadata, self._index_capacity, self._poll_s, name,
                              index_bytes=self._index_bytes, distrust_s=self._distrust_s, on_lie=self._lied,
                              check_timeout_s=self._check_timeout_s, dead_after_s=self._dead_after_s)
                   for a, name in wanted.items() if a not in self.replicas and a not in back}
            self.replicas = {a: r for a, r in {**self.replicas, **back, **new}.items() if a in wanted}
            self._leaving = {a: r for a, r in self._leaving.items() if a not in wanted}
            self._leaving.update((r.addr, r) for r in gone)
            ended = [r for r in self._leaving.values() if r.in_flight == 0]
            for r in ended:
                del self._leaving[r.addr]
        for r in gone:
            log.info("decode replica %s is gone from %s: no new request goes there", r.addr, ", ".join(self.targets))
        for r in ended:
            r.close()
        for r in new.values():
            log.info("decode replica %s", r.addr)
            if self._started:
                r.start()

    def _keep_resolving(self) -> None:
        while not self._stop.wait(self._resolve_every_s):
            self._resolve()


def _refusals(messages: dict[str, str]) -> str:
    return "; ".join(f"{addr}: {message}" for addr, message in messages.items())


def _bounded(time_left: float | None, most: float) -> float:
    return most if time_left is None else max(0.0, min(most, time_left))
