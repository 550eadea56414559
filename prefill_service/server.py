"""The Prefill gRPC servicer: protobuf in, domain call, protobuf out. Errors map in the interceptor."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import grpc

from kvserve.handoff.requests import (
    handle_to_proto,
    options_from_proto,
    prompt_from_proto,
    stored_blocks_from_proto,
)
from kvserve.rpc.server import Server
from prefill_service.service import PrefillJob, PrefillService
from protos.kvserve.v1 import prefill_pb2, prefill_pb2_grpc

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, service: PrefillService) -> None:
        self.service = service

    def Prefill(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        return handle_to_proto(self.service.prefill(_job(request, context)))

    def PrefillStream(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> Iterator[prefill_pb2.PrefillResponse]:
        for handle in self.service.prefill_stream(_job(request, context)):
            yield handle_to_proto(handle)


def _job(request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext) -> PrefillJob:
    remaining = context.time_remaining()
    return PrefillJob(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt=prompt_from_proto(request.prompt),
        options=options_from_proto(request.sampling, request.cache),
        deadline=time.monotonic() + remaining if remaining is not None else None,
        cancelled=lambda: not context.is_active(),
        num_stored_blocks=stored_blocks_from_proto(request),
    )


def add_to_server(server: Server, service: PrefillService) -> None:
    """The Prefill service on `server`; a call that arrives while the waiting prompts are at their bounds is
    refused there and then, before its request is read (rpc.server.Server.check_on_arrival)."""
    server.add(prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(service), SERVICE_NAME)
    for method in ("Prefill", "PrefillStream"):
        server.check_on_arrival(f"/{SERVICE_NAME}/{method}", service.admission.refusal, service.refused)
