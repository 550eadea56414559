"""kvserve's public Python client: `from client import Client`.

The names load on first use: importing a submodule (the `kvserve` pytest plugin, which every pytest
run of a project with kvserve installed loads) must not cost a grpc import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        UnauthenticatedError,
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
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("client.client"), name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")
