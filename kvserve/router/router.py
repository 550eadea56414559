"""Placing requests on decode replicas and relaying their streams (docs/DESIGN.md, "Router").

The prompt's block hashes come from one replica (`DecodeReplica.PrefixHashes`), which tokenizes and scopes
them to the caller's tenant exactly as the replica serving the request will; a router holds no model and no
tenant secret. The policy (router.policy) picks a replica from what each holds (router.index) and its load; a
replica also learns a request's blocks when the router sends it there, before its store says so, so that a
burst of turns of one chat stays together.

A replica that refuses a request as busy is passed over for the next, then all are asked again after a
backoff (protos.retry). A stream whose replica dies after its first token goes on from another, which
resumes after the tokens the caller has. Accepting is not answering: a replica that sends no first response
within `first_token_timeout_s` has its call cancelled and the request goes to another (nothing reached the
caller yet); failing again and again, it is ejected (router.policy.Outliers).
"""

from __future__ import annotations

import functools
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

from kvserve.router.index import INDEX_BYTES
from kvserve.router.policy import EJECT_AFTER, EJECTION_S, MAX_EJECTION_S, Outliers, Policy
from kvserve.router.replica import CHECK_TIMEOUT_S, DEAD_AFTER_S, DISTRUST_S, Metadata, Replica
from kvserve.router.replica import DECODE_SERVICE as DECODE_SERVICE  # where callers have imported it from
from kvserve.rpc.addresses import Targets
from kvserve.rpc.auth import ON_BEHALF_OF
from kvserve.rpc.errors import ResourceExhausted, ServiceError, Unavailable
from kvserve.rpc.tls import TLSConfig
from protos.block_hash import BlockHash
from protos.bounds import Lie, prompt_hashes
from protos.kvserve.v1 import decode_pb2
from protos.retry import Backoff, retry_after_s

log = logging.getLogger(__name__)

# A replica refusing a request with a retry hint (protos.retry) is only busy; without, it will refuse it again.
BUSY_ROUNDS = 3  # times the busy replicas are asked for a request they all refuse, before it is refused
BACKOFF_S = 0.05  # the wait between two such rounds (with full jitter) grows from this, doubling
MAX_BACKOFF_S = 2.0  # the longest wait between two rounds, whatever a replica hints
MAX_MIGRATIONS = 3  # times one request's stream is moved to another replica after its replica died
# A first response later than this means a replica that accepted the request and will not answer (hung), not a
# long prompt: 1.7x the slowest first token measured under load (17.9 s, a 10-round chat of 4 users on CPU with
# no cache, BENCHMARKS.md), and half the 60 s deadline callers give, leaving the other half to the next replica.
FIRST_TOKEN_TIMEOUT_S = 30.0


class Upstream(ServiceError):
    """A replica's own status, passed on to the caller as it came."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Progress:
    """What has become of one request so far."""

    backoff: Backoff  # between the rounds in which every replica refused it as busy
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


@dataclass(slots=True)
class _Attempt:
    """One call of a request to one replica."""

    replica: Replica
    held: int  # the leading blocks of the prompt it held
    watch: FirstTokenWatch | None  # None: no first-token deadline on this call
    answered: bool = False  # its first response came, in time
    finished: bool = False  # its result came: the caller has the whole answer


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
        `ejection_s` and `max_ejection_s`: see policy.Outliers."""
        self.policy = Policy(policy, load_weight)
        if not targets:
            raise ValueError("at least one decode replica address is needed")
        if first_token_timeout_s < 0:
            raise ValueError(f"first_token_timeout_s ({first_token_timeout_s}) must be at least 0")
        self.outliers = Outliers(eject_after, ejection_s, max_ejection_s)
        self.targets = list(targets)
        self._targets = Targets(self.targets)
        self._leaving: dict[str, Replica] = {}  # gone from the names' addresses, streams still open on them
        self._replica = functools.partial(
            Replica, tls=tls, metadata=list(metadata), index_capacity=index_capacity, poll_s=poll_s,
            index_bytes=index_bytes, distrust_s=distrust_s, on_lie=self._lied, check_timeout_s=check_timeout_s,
            dead_after_s=dead_after_s)
        self._metadata = list(metadata)
        self._resolve_every_s = resolve_every_s
        self.busy_rounds = busy_rounds
        self.max_migrations = max_migrations
        self.first_token_timeout_s = first_token_timeout_s
        self._random = random.Random()  # the backoffs' jitter
        self._timeouts: Counter[str] = Counter()  # replica: calls cancelled for want of a first response in time
        self._refusals: Counter[str] = Counter()  # replica: requests it refused as busy
        self._migrations: Counter[str] = Counter()  # outcome: streams moved (resumed), or not (limit, failed)
        self._overloaded = 0  # requests refused as busy, every replica having refused them
        self.on_route = on_route  # (replica, policy, leading blocks it held) of each request placed
        self.replicas: dict[str, Replica] = {}
        self._lies: Counter[tuple[str, str]] = Counter()  # (replica, reason): times it was distrusted
        self._lock = threading.Lock()
        self._hash_turn = itertools.count()  # which replica prefix_hashes asks
        self._stop = threading.Event()
        self._started = False
        self.resolve()
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
        return sum(not r.blocks.trusted for r in self._all())

    @property
    def num_ejected(self) -> int:
        return sum(r.ejection.ejected for r in self._all())

    @property
    def index_bytes(self) -> int:
        """What the replicas' indexes hold now, in bytes (BlockIndex.nbytes)."""
        return sum(r.blocks.nbytes for r in self._all())

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
        return self.outliers.ejections()

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
        """The prompt's block hashes from a healthy replica (the two asked at most, within `timeout_s` in all),
        asked with the router's own service token and, in `ON_BEHALF_OF`, the caller's (so that they are its
        tenant's); [] when none answers (the request is then placed by load alone, as when they are busy). A
        status about the request itself (a bad prompt) is the caller's, raised as it came; a refused token is
        placed by load too (the Generate call then says why, or the router's token is wrong: logged)."""
        asked = [*self._metadata, *((ON_BEHALF_OF, v) for k, v in metadata if k == "authorization")]
        deadline = time.monotonic() + timeout_s  # for both replicas asked together
        for replica in [r for r in self._healthy(self._hash_turn) if r.blocks.trusted][:2]:
            try:
                reply = replica.replica.PrefixHashes(request, metadata=asked,
                                                     timeout=max(0.0, deadline - time.monotonic()))
                return prompt_hashes(reply)
            except Lie as lie:
                replica.distrust(lie)
            except grpc.RpcError as exc:
                code, details = _status(exc)
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
        return self.policy.pick([r for r in self._all() if r.serving and r.addr not in avoid], hashes)

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
                  if self.policy.name == "prefix" else [])
        progress = _Progress(Backoff(initial_s=BACKOFF_S, max_s=MAX_BACKOFF_S, jitter=True, rng=self._random))
        try:
            yield from self._stream(request, hashes, metadata, time_left, on_call, progress)
        except ServiceError:
            if progress.moving:
                self._count(self._migrations, "failed")
            raise

    def _stream(self, request: decode_pb2.GenerateRequest, hashes: Sequence[BlockHash], metadata: Metadata,
                time_left: Callable[[], float | None], on_call: Callable[[Any], None],
                p: _Progress) -> Iterator[decode_pb2.GenerateResponse]:
        """`generate`'s tries, one replica after another, until one gives the caller its result."""
        while True:
            replica, held = self._place(hashes, p, time_left)
            call = replica.decode.Generate(_resumed(request, p.sent), metadata=metadata, timeout=time_left())
            on_call(call)
            a = _Attempt(replica, held, self._watch(call, replica, p, time_left))
            replica.started()
            try:
                yield from self._relay(call, a, hashes, p)
                failure = self._ended(a, p)
            except grpc.RpcError as exc:
                failure = self._broke(exc, a, p)
            finally:
                if a.watch is not None:
                    a.watch.stop()
                replica.ended()
            if a.finished:
                return
            if failure is not None:
                self._move(replica, p, failure)

    def _relay(self, call: Iterator[decode_pb2.GenerateResponse], a: _Attempt, hashes: Sequence[BlockHash],
               p: _Progress) -> Iterator[decode_pb2.GenerateResponse]:
        """The replica's responses, passed on as they come."""
        for response in call:
            if not a.answered:
                if a.watch is not None and not a.watch.answered():
                    continue  # it came as the router cancelled the call: the stream ends CANCELLED
                a.answered = True
                a.replica.blocks.learned(hashes)  # it will hold them: the next turn should find them here
                if self.on_route is not None:
                    self.on_route(a.replica.addr, self.policy.name, a.held)
                if p.moving:
                    self._count(self._migrations, "resumed")
                    p.moving = False
            if response.WhichOneof("kind") == "token":
                p.sent.append(response.token.token_id)
            else:
                a.finished = True
                a.replica.ejection.served()
            yield response

    def _ended(self, a: _Attempt, p: _Progress) -> str | None:
        """The replica's stream ended without an error: why it broke (the stream moves), or None when the caller
        has its result or the request goes to another replica (no first response in time)."""
        if a.finished:
            return None
        if a.watch is not None and a.watch.expired:
            self._late(a.replica, p, a.watch)
            return None
        if not a.answered:
            self._failed(a.replica, "it ended its stream without an answer")
            raise Upstream(grpc.StatusCode.INTERNAL, f"decode replica {a.replica.addr} ended without an answer")
        return "its stream ended without a result"

    def _broke(self, exc: grpc.RpcError, a: _Attempt, p: _Progress) -> str | None:
        """The replica's stream failed with `exc`: why (the stream moves), or None when the request goes to
        another replica or the caller has its result already; a status that is the caller's is raised."""
        code, details = _status(exc)
        details = details or code.name
        if code == grpc.StatusCode.CANCELLED and a.watch is not None and a.watch.expired:  # not the caller
            self._late(a.replica, p, a.watch)
            return None
        if not a.answered and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._count(self._refusals, a.replica.addr)
            hint_s = retry_after_s(exc)
            if hint_s is None:
                p.full[a.replica.addr] = details
            else:
                p.busy[a.replica.addr] = details
                p.hint_s = max(p.hint_s, hint_s)
            return None
        if a.finished:  # the caller has its whole answer: how the call ended after it changes nothing
            return None
        if code != grpc.StatusCode.UNAVAILABLE:
            raise Upstream(code, details) from exc
        if not a.answered:
            log.warning("decode replica %s failed before the first token (%s): trying another",
                        a.replica.addr, details)
            a.replica.mark_down()
            p.down[a.replica.addr] = details
            self._failed(a.replica, details)
            return None
        return details

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
        self.outliers.failed(replica, self._all(), why)

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
        healthy replica has refused it, those that were busy are asked again after a backoff (at least the
        longest wait a replica hinted); ResourceExhausted with a retry hint after `busy_rounds` rounds, or sooner
        when the backoff would outlast the caller's deadline, and without one when none was busy, only
        refusing; Unavailable when no replica is healthy."""
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
            wait = p.backoff.delay(hint_s=p.hint_s)
            left = time_left()
            if p.rounds >= self.busy_rounds or (left is not None and wait >= left):
                with self._lock:
                    self._overloaded += 1
                retry_s = p.hint_s or p.backoff.next_s
                raise ResourceExhausted(f"every decode replica is busy ({_refusals({**p.busy, **p.full})}), asked "
                                        f"{p.rounds} times; retry after {retry_s * 1000:.0f} ms", retry_after_s=retry_s)
            time.sleep(wait)
            p.busy.clear()
            p.hint_s = 0.0

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

    def resolve(self) -> None:
        """The replicas the names resolve to now (done every `resolve_every_s` once started). One gone from them
        (scaled down, or not ready for a moment) gets no new request, and its channel closes once the streams on
        it have ended (closing it would end them CANCELLED, a working replica's streams failed); one back in the
        meantime is taken back as it is."""
        wanted = self._targets.resolve()
        with self._lock:
            gone = [r for a, r in self.replicas.items() if a not in wanted]
            back = {a: r for a, r in self._leaving.items() if a in wanted}
            new = {a: self._replica(a, target_name=name)
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
            self.resolve()


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """A failed call's code and details."""
    if not isinstance(exc, grpc.Call):
        return grpc.StatusCode.UNKNOWN, str(exc)
    return exc.code(), exc.details()


def _resumed(request: decode_pb2.GenerateRequest, sent: array[int]) -> decode_pb2.GenerateRequest:
    """The request as a replica gets it: a moved stream's continues after the tokens the caller has."""
    if not sent:
        return request
    upstream = decode_pb2.GenerateRequest()
    upstream.CopyFrom(request)
    upstream.resume_token_ids.extend(sent)
    return upstream


def _refusals(messages: dict[str, str]) -> str:
    return "; ".join(f"{addr}: {message}" for addr, message in messages.items())


def _bounded(time_left: float | None, most: float) -> float:
    return most if time_left is None else max(0.0, min(most, time_left))
