"""The DecodeReplica servicer: what `kvserve router` asks of a decode replica to place requests.

A router places a request where the most of its leading blocks are already held. It asks one
replica for the prompt's block hashes (this replica tokenizes the prompt as prefill will, in the
namespace its tenant gets: routers hold no model and no tenant secret), learns which blocks each
replica holds from Events, and weighs that against Load. Events carries two streams: the node
store's own, relayed, and this replica's KV pool (tier TIER_ENGINE: a snapshot when the stream
starts, then what each engine step named and evicted), so that a chat's next turn goes to the
replica whose pool still holds its history, where decode computes only the new question.

Events keeps within what a router believes (protos.bounds): every event names at most MAX_EVENT_HASHES
hashes (the pool's snapshot and the store's batches go in pieces), and a store event with a malformed
hash, kind or tier ends the stream (UNAVAILABLE, naming the store) instead of being passed on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc

from decode_service.metrics import DecodeMetrics
from decode_service.server import DecodeServicer
from kvserve.engine.engine import Engine
from kvserve.engine.hashing import prefix_hashes
from kvserve.handoff.requests import check_text_fits, encode, options_from_proto, prompt_from_proto
from kvserve.rpc.errors import Unavailable
from kvstore import KVStoreClient
from protos.block_hash import BlockHash
from protos.bounds import STORE_TIERS, Lie, check_event, pieces
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
from protos.retry import Backoff

log = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeReplica"].full_name
LOAD_METHOD = f"/{SERVICE_NAME}/Load"
EVENTS_BEHIND = 1024  # events an Events stream may fall behind before it is ended (its router follows again)
_POLL_S = 0.5  # how often a waiting Events stream checks that its caller is still there
Event = kvstore_pb2.Event


class PoolEvents:
    """The block hashes in this replica's KV pool, for every Events stream: a snapshot as a stream starts,
    then the changes of each engine step (``changed`` is the engine's on_pool_change). A stream whose
    caller falls EVENTS_BEHIND events behind is ended, so a slow reader costs the step thread nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[bytes, None] = {}
        self._streams: list[queue.Queue[Event | None]] = []

    def changed(self, named: list[BlockHash], evicted: list[BlockHash]) -> None:
        events = [*_events(Event.KIND_STORED, named), *_events(Event.KIND_REMOVED, evicted)]
        with self._lock:
            self._held.update(dict.fromkeys(named))
            for h in evicted:
                self._held.pop(h, None)
            for stream in list(self._streams):
                try:
                    for event in events:
                        stream.put_nowait(event)
                except queue.Full:  # its caller follows again, and starts from a new snapshot
                    self._streams.remove(stream)
                    with stream.mutex:
                        stream.queue.clear()
                        stream.queue.append(None)
                        stream.not_empty.notify()

    def subscribe(self) -> queue.Queue[Event | None]:
        """A queue of this pool's events, the first the snapshot of what it holds now; None ends it."""
        with self._lock:
            snapshot = _events(Event.KIND_STORED, list(self._held)) or [
                Event(kind=Event.KIND_STORED, tier=kvstore_pb2.TIER_ENGINE)]  # an empty pool's
            stream: queue.Queue[Event | None] = queue.Queue(EVENTS_BEHIND + len(snapshot))
            for event in snapshot:
                stream.put_nowait(event)
            self._streams.append(stream)
        return stream

    def unsubscribe(self, stream: queue.Queue[Event | None]) -> None:
        with self._lock:
            if stream in self._streams:
                self._streams.remove(stream)


class DecodeReplicaServicer(decode_pb2_grpc.DecodeReplicaServicer):
    def __init__(self, front: DecodeServicer, engine: Engine, store: KVStoreClient, metrics: DecodeMetrics,
                 pool_events: PoolEvents) -> None:
        self.front = front  # scopes the cache salt to the caller's tenant, as Generate does
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.pool_events = pool_events

    def PrefixHashes(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> decode_pb2.PrefixHashesResponse:
        options = self.front.scoped(options_from_proto(request.sampling, request.cache))
        prompt = prompt_from_proto(request.prompt)
        check_text_fits(self.engine.model, prompt, options.max_tokens)  # as Generate: OUT_OF_RANGE, untokenized
        ids = encode(self.engine.model, prompt)
        bs = self.engine.block_size
        hashes = prefix_hashes(ids, bs, self.engine.namespace(options.cache_salt).root()) if options.prefix_cache else []
        return decode_pb2.PrefixHashesResponse(hashes=hashes, prompt_tokens=len(ids), block_size=bs)

    def Load(self, request: decode_pb2.LoadRequest, context: grpc.ServicerContext) -> decode_pb2.LoadResponse:  # noqa: N802
        running, waiting = self.metrics.running_and_waiting()
        return decode_pb2.LoadResponse(running=running, waiting=waiting)

    def Events(  # noqa: N802 - gRPC method name
        self, request: kvstore_pb2.EventsRequest, context: grpc.ServicerContext
    ) -> Iterator[kvstore_pb2.Event]:
        """The pool's events and the store's, merged; ends (UNAVAILABLE) when the store sends an event out of
        bounds. A store stream that ends or is refused (the store restarting, or serving as many as it will) is
        asked again, 0.5 s doubling to 5 s, while the pool's events go on: the router keeps its view of this
        pool, and learns of the store's blocks again once the store takes the stream (those stored or removed
        in between it does not hear of)."""
        stream = self.pool_events.subscribe()
        relay = StoreRelay(self.store, stream, context.is_active)
        context.add_callback(relay.cancel)
        threading.Thread(target=relay.run, name="store-events", daemon=True).start()
        try:
            while context.is_active():
                try:
                    event = stream.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if event is None:
                    break
                yield event
        finally:
            self.pool_events.unsubscribe(stream)
            relay.cancel()
        if relay.lie is not None and context.is_active():
            log.warning("the events of this replica's store (%s) are out of bounds (%s): ending the "
                        "stream that relayed them", self.store.addr, relay.lie)
            raise Unavailable(f"the events of this replica's store ({self.store.addr}) are out of bounds: {relay.lie}")


class StoreRelay:
    """The store's events into an Events stream's queue, waiting for room: they must not be lost. A store stream
    that ends or is refused is asked again, 0.5 s doubling to 5 s, while ``active()``; one with an event out of
    bounds ends the relay: ``lie`` says why, and the queue gets None."""

    def __init__(self, store: KVStoreClient, stream: queue.Queue[Event | None], active: Callable[[], bool]) -> None:
        self.store = store
        self.stream = stream
        self.active = active
        self.call = store.watch_events()  # the store's stream now (one at a time)
        self.lie: Lie | None = None

    def cancel(self) -> None:
        self.call.cancel()

    def run(self) -> None:
        backoff = Backoff(initial_s=0.5, max_s=5.0, stable_s=5.0)
        while self.active():
            call, opened = self.call, time.monotonic()
            try:
                self._relay(call)
            except Lie as lie:
                call.cancel()
                self.lie = lie
                with contextlib.suppress(queue.Full):
                    self.stream.put(None, timeout=_POLL_S)
                return
            except grpc.RpcError as exc:
                log.debug("the events of this replica's store (%s) ended (%s): asking again", self.store.addr,
                          exc.code().name if isinstance(exc, grpc.Call) else exc)
            self._sleep(backoff.delay(time.monotonic() - opened))
            if self.active():
                self.call = self.store.watch_events()
                if not self.active():
                    self.call.cancel()

    def _relay(self, call: Iterable[Event]) -> None:
        for batch in call:
            check_event(batch, STORE_TIERS, most=None)  # as long as the store's message allows
            for hashes in pieces(batch.hashes):
                self._put(Event(kind=batch.kind, hashes=hashes, tier=batch.tier))

    def _put(self, event: Event) -> None:
        while self.active():
            try:
                self.stream.put(event, timeout=_POLL_S)
                return
            except queue.Full:
                pass

    def _sleep(self, delay_s: float) -> None:
        end = time.monotonic() + delay_s
        while self.active() and time.monotonic() < end:
            time.sleep(min(_POLL_S, max(0.0, end - time.monotonic())))


def _events(kind: Event.Kind, hashes: Sequence[bytes]) -> list[Event]:
    """Events of the pool naming `hashes`, in pieces a router takes."""
    return [Event(kind=kind, hashes=piece, tier=kvstore_pb2.TIER_ENGINE) for piece in pieces(hashes)]
