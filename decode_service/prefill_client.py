"""Decode's client of the prefill service: a deadline on every call, errors as ServiceErrors."""

from __future__ import annotations

import grpc

from decode_service.scheduler import Cancellation
from kvstore.serving import CHANNEL_OPTIONS, ServiceError, Unavailable
from prefill_service.handle import PrefillHandle, handle_from_proto
from prefill_service.requests import PromptInput, RequestOptions, options_to_proto, prompt_to_proto
from protos.kvserve.v1 import prefill_pb2, prefill_pb2_grpc

# Reconnect quickly once a restarted prefill service is back.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)]
PASSED_THROUGH = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
})


class UpstreamError(ServiceError):
    """A status from the prefill service, passed on to the client with its code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PrefillCancelled(Exception):
    """The client went away while prefill ran."""


class PrefillClient:
    def __init__(self, addr: str, timeout_s: float = 60.0) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self._stub = prefill_pb2_grpc.PrefillStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def prefill(
        self, request_id: str, prompt: PromptInput, options: RequestOptions, *,
        cancel: Cancellation, time_left_s: float | None = None,
    ) -> PrefillHandle:
        """Runs prefill within min(timeout_s, time_left_s); PrefillCancelled if `cancel` fires first."""
        sampling, cache = options_to_proto(options)
        request = prefill_pb2.PrefillRequest(
            request_id=request_id, prompt=prompt_to_proto(prompt), sampling=sampling, cache=cache
        )
        timeout = self.timeout_s if time_left_s is None else max(0.0, min(self.timeout_s, time_left_s))
        future = self._stub.Prefill.future(request, timeout=timeout)
        cancel.on_cancel(future.cancel)
        try:
            return handle_from_proto(future.result())
        except grpc.FutureCancelledError as exc:
            raise PrefillCancelled() from exc
        except grpc.RpcError as exc:
            raise self._error(exc, timeout) from exc

    def _error(self, exc: grpc.RpcError, timeout_s: float) -> ServiceError:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if code == grpc.StatusCode.CANCELLED:
            raise PrefillCancelled()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return UpstreamError(code, f"the prefill service at {self.addr} did not answer within {timeout_s:.1f} s")
        if code in PASSED_THROUGH:
            return UpstreamError(code, details or f"prefill failed with {code.name}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(f"the prefill service at {self.addr} is unavailable: {details}")
        return UpstreamError(grpc.StatusCode.INTERNAL, f"prefill at {self.addr} failed ({code.name}): {details}")
