"""The DecodeReplica servicer: what `kvserve router` asks of a decode replica to place requests.

A router places a request where the most of its leading blocks are already held. It asks one
replica for the prompt's block hashes (this replica tokenizes the prompt as prefill will, in the
namespace its tenant gets: routers hold no model and no tenant secret), learns which blocks each
replica's node holds from Events (the node store's own stream, relayed: every full block in a
replica's KV pool is saved to that store as well), and weighs that against Load.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from decode_service.metrics import DecodeMetrics
from decode_service.server import DecodeServicer
from engine.engine import Engine
from engine.hashing import prefix_hashes
from handoff.requests import encode, options_from_proto, prompt_from_proto
from kvstore import KVStoreClient
from protos.kvserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
from rpc.errors import Unavailable

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeReplica"].full_name


class DecodeReplicaServicer(decode_pb2_grpc.DecodeReplicaServicer):
    def __init__(self, front: DecodeServicer, engine: Engine, store: KVStoreClient, metrics: DecodeMetrics) -> None:
        self.front = front  # scopes the cache salt to the caller's tenant, as Generate does
        self.engine = engine
        self.store = store
        self.metrics = metrics

    def PrefixHashes(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> decode_pb2.PrefixHashesResponse:
        options = self.front.scoped(options_from_proto(request.sampling, request.cache))
        ids = encode(self.engine.model, prompt_from_proto(request.prompt))
        bs = self.engine.block_size
        hashes = prefix_hashes(ids, bs, self.engine.namespace(options.cache_salt).root()) if options.prefix_cache else []
        return decode_pb2.PrefixHashesResponse(hashes=hashes, prompt_tokens=len(ids), block_size=bs)

    def Load(self, request: decode_pb2.LoadRequest, context: grpc.ServicerContext) -> decode_pb2.LoadResponse:  # noqa: N802
        running, waiting = self.metrics.running_and_waiting()
        return decode_pb2.LoadResponse(running=running, waiting=waiting)

    def Events(  # noqa: N802 - gRPC method name
        self, request: kvstore_pb2.EventsRequest, context: grpc.ServicerContext
    ) -> Iterator[kvstore_pb2.Event]:
        call = self.store.watch_events()
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as exc:
            if context.is_active():
                raise Unavailable(f"the events of this replica's store ({self.store.addr}) ended: "
                                  f"{exc.code().name}: {exc.details()}") from exc  # type: ignore[attr-defined]
