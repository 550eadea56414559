"""kvserve's public Python client: `from client import Client`."""

from client.client import (
    AsyncClient,
    Chunk,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVServeError,
    OutOfRangeError,
    ResourceExhaustedError,
    Result,
    Timings,
    UnavailableError,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "KVServeError",
    "OutOfRangeError",
    "ResourceExhaustedError",
    "Result",
    "Timings",
    "UnavailableError",
    "Usage",
]
