"""Store errors. Each names its gRPC status (`grpc_status`) so the store stays free of grpc;
rpc.errors.status_of maps them for the servers' one interceptor."""

from __future__ import annotations


class StoreError(Exception):
    grpc_status = "INTERNAL"


class InvalidRequest(StoreError, ValueError):
    """Bad input: wrong hash length, empty payload, checksum mismatch, bad chunking."""

    grpc_status = "INVALID_ARGUMENT"


class BlockTooLarge(StoreError):
    grpc_status = "RESOURCE_EXHAUSTED"


class StoreFull(StoreError):
    """No tier can make room (every tier is full of pinned blocks), or too many leases."""

    grpc_status = "RESOURCE_EXHAUSTED"


class UnknownLease(StoreError):
    grpc_status = "NOT_FOUND"
