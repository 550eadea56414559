"""Errors a server answers with, and the one mapping from an exception to a gRPC status.

Servicers raise `ServiceError` subclasses; domain code that must stay free of grpc (the store's
index, the engine) names its status in a `grpc_status` class attribute instead. Anything else,
a plain ValueError of our own included, is a bug of ours: INTERNAL, never the caller's fault.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An error with a gRPC status code and a message a person can act on."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(ServiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    """Out of capacity. With `retry_after_s` the server is only busy, and says when to try again (the
    `retry-after-ms` trailer, protos.retry); without, retrying the same request will not help (it can never
    fit, or a per-caller cap is reached)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status an RPC ends with when `exc` escapes its handler."""
    if isinstance(exc, ServiceError):
        return exc.code
    code_name = getattr(exc, "grpc_status", None)
    if isinstance(code_name, str) and code_name in grpc.StatusCode.__members__:
        return grpc.StatusCode[code_name]
    return grpc.StatusCode.INTERNAL
