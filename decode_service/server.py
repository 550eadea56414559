"""The Decode gRPC servicer: protobuf in, domain stream, protobuf out. Errors map in the interceptor."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator

import grpc

from decode_service.cancellation import Cancellation
from decode_service.service import DecodeService, GenerateJob, GenerateOutcome
from decode_service.stopping import TokenOutput
from kvserve.handoff.requests import RequestOptions, options_from_proto, prompt_from_proto
from kvserve.rpc.auth import TenantSalts, Unauthenticated, current_tenant
from kvserve.rpc.server import Server
from protos.kvserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def _response(item: TokenOutput | GenerateOutcome) -> decode_pb2.GenerateResponse:
    if isinstance(item, TokenOutput):
        return decode_pb2.GenerateResponse(token=decode_pb2.TokenChunk(token_id=item.token_id, text=item.text))
    u, t = item.usage, item.timings
    return decode_pb2.GenerateResponse(result=decode_pb2.GenerateResult(
        finish_reason=item.finish_reason,
        text=item.text,
        token_ids=list(item.token_ids),
        prompt_token_ids=list(item.prompt_token_ids),
        usage=common_pb2.Usage(
            prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens
        ),
        timings=common_pb2.Timings(ttft_s=t.ttft_s, prefill_s=t.prefill_s, decode_s=t.decode_s, total_s=t.total_s,
                                   prefill_path=t.prefill_path),
    ))


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """With `tenant_salts` (auth on), each request's cache salt is its tenant's (`kvserve.rpc.auth`), which
    prefill receives too: the client's cache_salt only narrows inside the tenant's namespace."""

    def __init__(self, service: DecodeService, tenant_salts: TenantSalts | None = None) -> None:
        self.service = service
        self.tenant_salts = tenant_salts

    def scoped(self, options: RequestOptions) -> RequestOptions:
        if self.tenant_salts is None:
            return options
        tenant = current_tenant()
        if tenant is None:  # an internal call that names no tenant, or no AuthInterceptor in front
            raise Unauthenticated("this service requires a bearer token (a service calling for a tenant sends the "
                                  "tenant's in kvserve-on-behalf-of)")
        return dataclasses.replace(options, cache_salt=self.tenant_salts.salt(tenant, options.cache_salt))

    def Generate(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.GenerateResponse]:
        arrival = time.perf_counter()
        try:
            job = GenerateJob(
                request_id=request.request_id or uuid.uuid4().hex,
                prompt=prompt_from_proto(request.prompt),
                options=self.scoped(options_from_proto(request.sampling, request.cache)),
                arrival=arrival,
                time_left_s=context.time_remaining(),
                resume=tuple(request.resume_token_ids),
            )
        except Exception as exc:  # bad input, no valid token: the service counts it, never sees the job
            self.service.refused(exc)
            raise
        cancel = Cancellation()
        if not context.add_callback(cancel.cancel):  # the call ended before its handler ran: nobody to answer
            cancel.cancel()
        for item in self.service.generate(job, cancel):
            yield _response(item)


def add_to_server(server: Server, front: DecodeServicer) -> None:
    """Decode's front door on `server`. Not refused unread as it arrives (rpc.server.Server.check_on_arrival) while
    the waiting work is at its bounds: a request that can never fit is told so whatever the load, which takes its
    request read; the service refuses the rest as busy before it tokenizes (DecodeService._refuse_early)."""
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, front, SERVICE_NAME)
