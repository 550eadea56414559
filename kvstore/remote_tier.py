"""The remote tier: KV blocks shared by every store through Redis or Valkey (one server or a cluster).

It holds copies, not placements, so it is not a TierStorage: the store's index knows nothing of it.
- Writes go behind: a block stored in the local tiers (never an ephemeral one) is queued, and one
  thread writes the queue in pipelined batches, each key with an expiry. A Put never waits on Redis;
  a full queue drops its oldest blocks (counted). Demoted and evicted blocks are not written again:
  they were written when stored, and only their expiry or Redis's own eviction drops them there.
- Reads: on a local miss the store asks for the blocks it lacks, MGET_KEYS per round trip (MGET, or
  one MGET per slot in a cluster), verifies each record and promotes the hits into its local tiers.
- Failures: an error or a timeout is a miss (or lost writes) and a metric, never the caller's error.
  After BREAKER_FAILURES failures in a row a circuit breaker stops the calls for a cool-down (1 s,
  doubling to 30 s while probes fail), then lets one probe through; its success closes it. redis-py's
  pools reconnect by themselves. The store never calls this while holding its lock.

Keys are `<prefix>:v<RECORD_VERSION>:<hex hash>`; values are store records (kvstore/block_format.py),
sealed under the record key, so a reader of Redis sees no KV, a record of another layout is never read, and
one damaged, moved from another key, forged, or written under another record key fails to open (`mac_failures`;
`checksum_failures` in plaintext mode): misses all.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvstore.block_format import RECORD_VERSION, CorruptBlock, ForeignRecord, pack_record, unpack_record
from kvstore.config import RemoteConfig
from kvstore.record_key import RecordKey
from kvstore.types import LATENCY_BUCKETS_S, Buffer, Latency, RemoteStats
from protos.block_hash import BlockHash

log = logging.getLogger(__name__)

BREAKER_FAILURES = 3
FIRST_COOLDOWN_S, MAX_COOLDOWN_S = 1.0, 30.0
MGET_KEYS = 32  # blocks asked for per round trip
BATCH_BLOCKS, BATCH_BYTES = 64, 8 << 20  # blocks written per pipeline (at least one)
CLOSE_FLUSH_S = 2.0

ReadBlock = Callable[[BlockHash], tuple[Buffer, int] | None]  # a stored block's payload and checksum
Found = tuple[bytes, int]  # a verified payload and its checksum
T = TypeVar("T")


class Breaker:
    """Closed: calls go through. `failures` failures in a row open it: `allow` says no for a cool-down,
    then yes once (half-open: a probe). The probe's success closes it; its failure doubles the
    cool-down, up to `max_cooldown_s`. A probe that never reports lets another through a cool-down later."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, failures: int = BREAKER_FAILURES,
                 first_cooldown_s: float = FIRST_COOLDOWN_S, max_cooldown_s: float = MAX_COOLDOWN_S) -> None:
        self._clock = clock
        self._threshold = failures
        self._first, self._max = first_cooldown_s, max_cooldown_s
        self._lock = threading.Lock()
        self._failures = 0
        self.cooldown_s = first_cooldown_s
        self._retry_at: float | None = None  # None: closed
        self._probing = False

    @property
    def state(self) -> str:
        with self._lock:
            return "closed" if self._retry_at is None else "half_open" if self._probing else "open"

    def allow(self) -> bool:
        with self._lock:
            if self._retry_at is None:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self.cooldown_s
            self._probing = True
            return True

    def success(self) -> bool:
        """Records a call that worked; True when that closed the breaker."""
        with self._lock:
            was_open = self._retry_at is not None
            self._failures, self.cooldown_s, self._retry_at, self._probing = 0, self._first, None, False
            return was_open

    def failure(self) -> bool:
        """Records a failed call; True when that opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._retry_at is None:
                if self._failures < self._threshold:
                    return False
                self._open()
                return True
            if self._probing:  # the probe failed: wait longer
                self.cooldown_s = min(2 * self.cooldown_s, self._max)
                self._open()
            return False

    def trip(self) -> None:
        """Opens it now (the remote did not answer at start)."""
        with self._lock:
            self._open()

    def _open(self) -> None:
        self._retry_at = self._clock() + self.cooldown_s
        self._probing = False


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.seconds = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.seconds += seconds

    def snapshot(self) -> Latency:
        return Latency(sum(self.counts), self.seconds, tuple(self.counts))


COUNTERS = ("hits", "misses", "read_errors", "write_errors", "checksum_failures", "mac_failures", "read_bytes",
            "written_blocks", "written_bytes", "dropped_writes")  # RemoteStats' fields counted as they happen


def redacted(url: str) -> str:
    """The URL without its password, and without its query (which may carry one)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return urlunsplit((parts.scheme, f"{userinfo}{at}{hostport}", parts.path, "", ""))


def connect(config: RemoteConfig) -> Any:
    """A redis-py client of the remote (a RedisCluster when `config.cluster`, which asks the node for the
    cluster's layout now). No retries: the breaker decides when to call again."""
    kwargs: dict[str, Any] = {"socket_timeout": config.timeout_s, "socket_connect_timeout": config.timeout_s,
                              "retry": Retry(NoBackoff(), 0)}
    if config.tls_ca:
        kwargs["ssl_ca_certs"] = config.tls_ca
    if config.tls_cert:
        kwargs["ssl_certfile"], kwargs["ssl_keyfile"] = config.tls_cert, config.tls_key
    if config.cluster:
        return RedisCluster.from_url(config.url, **kwargs)
    return redis.Redis.from_url(config.url, **kwargs)


class RemoteTier:
    """Blocks in Redis or Valkey, shared by every store configured with the same URL and key prefix."""

    def __init__(self, config: RemoteConfig, *, clock: Callable[[], float] = time.monotonic,
                 record_key: RecordKey | None = None) -> None:
        """`record_key`: the key records are sealed under (None: in the clear, bound to their keys by checksum
        only, so whoever can read Redis reads the KV and whoever can write to it can forge them)."""
        self.config = config
        self.record_key = record_key
        self.url = redacted(config.url)
        self.breaker = Breaker(clock)
        self._client: Any = None  # redis.Redis | RedisCluster, made on first use
        self._client_lock = threading.Lock()
        self._queue: OrderedDict[BlockHash, int] = OrderedDict()  # block -> payload bytes, oldest first
        self._queued_bytes = 0
        self._in_flight = 0  # blocks of the batch being written
        self._cond = threading.Condition()
        self._closing = False
        self._read_block: ReadBlock | None = None
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()  # counters and histograms
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._latency = {"read": _Histogram(), "write": _Histogram()}

    def key(self, block: BlockHash) -> str:
        return f"{self.config.key_prefix}:v{RECORD_VERSION}:{block.hex()}"

    def start(self, read_block: ReadBlock) -> None:
        """Checks the remote with one PING, says which it is, and starts the writer, which reads the blocks
        it writes with `read_block`. A remote that does not answer is not fatal: the breaker opens."""
        self._read_block = read_block
        where = (f"remote tier {self.url}{' (cluster)' if self.config.cluster else ''}, keys "
                 f"{self.config.key_prefix}:v{RECORD_VERSION}:<hash>, expiry {self.config.ttl_s:g} s, "
                 f"timeout {self.config.timeout_s:g} s")
        try:
            self._redis().ping()
            log.info("%s", where)
        except Exception as exc:  # not fatal: the breaker retries
            self.breaker.trip()
            log.warning("%s: unreachable (%s); serving from the local tiers, trying again in %g s", where,
                        _why(exc), self.breaker.cooldown_s)
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-remote-writer", daemon=True)
        self._writer.start()

    # -- reads ---------------------------------------------------------------------------------

    def get(self, keys: Sequence[BlockHash]) -> list[Found | None]:
        """Each block's verified payload and checksum, None where the remote has no good copy."""
        out: list[Found | None] = []
        for start in range(0, len(keys), MGET_KEYS):
            out += self._fetch(keys[start : start + MGET_KEYS])
        hits = sum(found is not None for found in out)
        self._count(hits=hits, misses=len(out) - hits)
        return out

    def get_prefix(self, keys: Sequence[BlockHash]) -> list[Found]:
        """The leading blocks of `keys` that the remote holds, asked for until the first gap."""
        out: list[Found] = []
        for start in range(0, len(keys), MGET_KEYS):
            for found in self._fetch(keys[start : start + MGET_KEYS]):
                if found is None:
                    break
                out.append(found)
            if len(out) < min(start + MGET_KEYS, len(keys)):
                break
        self._count(hits=len(out), misses=int(len(out) < len(keys)))
        return out

    def _fetch(self, keys: Sequence[BlockHash]) -> list[Found | None]:
        names = [self.key(k) for k in keys]

        def mget() -> list[bytes | None]:
            client = self._redis()
            return list(client.mget_nonatomic(names) if self.config.cluster else client.mget(names))

        values = self._call("read", mget) if self.breaker.allow() else None
        if values is None:
            return [None] * len(keys)
        return [self._verify(k, v) for k, v in zip(keys, values, strict=True)]

    def _verify(self, key: BlockHash, value: bytes | None) -> Found | None:
        if value is None:
            return None
        try:
            found = unpack_record(key, value, self.record_key)
        except CorruptBlock as exc:
            # Left there: the store that computes the block again writes over it (and it expires).
            log.warning("remote block %s failed its check (%s): a miss", key.hex()[:16], exc)
            foreign = isinstance(exc, ForeignRecord)
            self._count(read_bytes=len(value), checksum_failures=int(not foreign), mac_failures=int(foreign))
            return None
        self._count(read_bytes=len(value))
        return found

    # -- writes --------------------------------------------------------------------------------

    def write_behind(self, key: BlockHash, size: int) -> None:
        """Queues a block just stored locally, for the writer; never waits. A full queue drops its oldest."""
        dropped = 0
        with self._cond:
            if self._closing or key in self._queue:
                return
            self._queue[key] = size
            self._queued_bytes += size
            while self._queued_bytes > self.config.queue_bytes:
                _, old = self._queue.popitem(last=False)
                self._queued_bytes -= old
                dropped += 1
            self._cond.notify_all()
        if dropped:
            self._count(dropped_writes=dropped)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued block is written or dropped; False when timeout_s passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = CLOSE_FLUSH_S) -> None:
        """Writes what is queued within about timeout_s (unless the remote is failing), then stops."""
        if self.breaker.state == "closed":
            self.flush(timeout_s)
        with self._cond:
            self._closing = True
            dropped = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._count(dropped_writes=dropped)
        if self._writer is not None:
            self._writer.join(timeout_s)
        with self._client_lock:
            if self._client is not None:
                self._client.close()

    def _write_loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._write(batch)
            except Exception:  # the writer outlives every failure
                log.exception("remote tier writer: %d blocks not written", len(batch))
                self._count(dropped_writes=len(batch))
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()

    def _next_batch(self) -> list[BlockHash] | None:
        """The oldest queued blocks, once the breaker lets a call through; None when closing."""
        with self._cond:
            while not (self._queue and self.breaker.allow()):
                if self._closing:
                    return None
                self._cond.wait(0.1 if self._queue else None)  # breaker open: look again soon
            batch: list[BlockHash] = []
            size = 0
            while self._queue and len(batch) < BATCH_BLOCKS:
                key, n = next(iter(self._queue.items()))
                if batch and size + n > BATCH_BYTES:
                    break
                self._queue.popitem(last=False)
                self._queued_bytes -= n
                batch.append(key)
                size += n
            self._in_flight = len(batch)
            return batch

    def _write(self, batch: list[BlockHash]) -> None:
        assert self._read_block is not None
        records = []
        for key in batch:
            found = self._read_block(key)
            if found is not None:  # else gone from the local tiers already
                records.append((self.key(key), pack_record(key, *found, self.record_key)))
        ttl_ms = max(1, int(self.config.ttl_s * 1000))

        def set_all() -> list[Any]:
            pipe = self._redis().pipeline(transaction=False)
            for name, value in records:
                pipe.set(name, value, px=ttl_ms)
            return list(pipe.execute())

        written = bool(records) and self._call("write", set_all) is not None
        if written:
            self._count(written_blocks=len(records), written_bytes=sum(len(v) for _, v in records),
                        dropped_writes=len(batch) - len(records))
        else:
            self._count(dropped_writes=len(batch))

    # -- calls and figures ---------------------------------------------------------------------

    def _redis(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = connect(self.config)
            return self._client

    def _call(self, op: str, fn: Callable[[], T]) -> T | None:
        """fn's result, or None when it failed: counted, and logged when the breaker opens."""
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # whatever the remote does is a miss, never the caller's error
            self._observe(op, start, failed=True)
            if self.breaker.failure():
                log.warning("remote tier %s failing (%s): not called for %g s", self.url, _why(exc),
                            self.breaker.cooldown_s)
            return None
        self._observe(op, start)
        if self.breaker.success():
            log.info("remote tier %s answers again", self.url)
        return result

    def _observe(self, op: str, start: float, failed: bool = False) -> None:
        with self._lock:
            self._latency[op].observe(time.perf_counter() - start)
            if failed and op == "read":
                self._counts["read_errors"] += 1
            elif failed:
                self._counts["write_errors"] += 1

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._counts[name] += n

    def stats(self) -> RemoteStats:
        with self._cond:
            queued_blocks, queued_bytes = len(self._queue), self._queued_bytes
        with self._lock:
            counts = dict(self._counts)
            read, write = self._latency["read"].snapshot(), self._latency["write"].snapshot()
        return RemoteStats(self.url, self.breaker.state, **counts, queued_blocks=queued_blocks,
                           queued_bytes=queued_bytes, read_latency=read, write_latency=write)


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
