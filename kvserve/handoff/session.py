"""The KV store used as a cache: every call is best effort (docs/DESIGN.md, "Failure policy").

A store that is down, slow or failing is a miss, never an error for the request. The first
failure within a request ends the store's part in it (no second deadline to wait out), and each
failure is reported to `on_failure(op)` for the metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc

from kvstore import KVStoreClient, Part, Payload, PutResult
from protos.block_hash import BlockHash

if TYPE_CHECKING:
    from kvstore import Device, Tensor

log = logging.getLogger(__name__)

# grpc.RpcError: down, slow or refusing; OSError: its shared-memory path; ValueError: a bad answer.
STORE_ERRORS = (grpc.RpcError, OSError, ValueError)
# and, moving tensors: RuntimeError from torch or CUDA (a device arena that could not be opened or copied)
TENSOR_ERRORS = (*STORE_ERRORS, RuntimeError)
T = TypeVar("T")


class StoreSession:
    """One request's view of the store, for the services that use it as a cache (prefill, decode)."""

    def __init__(self, client: KVStoreClient, on_failure: Callable[[str], None]) -> None:
        self._client = client
        self._on_failure = on_failure
        self.failed = False
        self._lease_lock = threading.Lock()
        self._lease_ttl_s: float | None = None  # puts lease their blocks (lease_puts) until take_put_lease
        self._put_lease = ""
        self._put_lease_whole = True

    def _fail(self, op: str, exc: Exception) -> None:
        self.failed = True
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):  # gRPC's, or the same-host channel's
            log.warning("KV store %s failed (%s): going on without the cache", op, exc.code())
        else:  # not the network: shared-memory staging or a malformed answer
            log.warning("KV store %s failed: going on without the cache", op, exc_info=exc)
        self._on_failure(op)

    def lookup(self, hashes: Sequence[BlockHash], lease_ttl_s: float | None) -> tuple[int, str]:
        """(number of leading hits, lease id or ""). A store that refuses the lease (this caller pins as
        much as it may, or the store holds too many leases) is asked again without one: the hits still
        count, they are only not held for decode."""
        if self.failed or not hashes:
            return 0, ""
        try:
            try:
                result = self._client.lookup(hashes, lease_ttl_s=lease_ttl_s)
            except grpc.RpcError as exc:
                if not lease_ttl_s or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                    raise
                log.info("KV store refused a lease (%s): looking up without one", exc.details())  # type: ignore[attr-defined]
                result = self._client.lookup(hashes)
        except STORE_ERRORS as exc:
            self._fail("lookup", exc)
            return 0, ""
        return result.num_hits, result.lease_id or ""

    def _call(self, op: str, call: Callable[[], T], default: T, errors: tuple[type[Exception], ...] = STORE_ERRORS
              ) -> T:
        """``call()``, or ``default`` once the store failed in this request (this call's failure included)."""
        if self.failed:
            return default
        try:
            return call()
        except errors as exc:
            self._fail(op, exc)
            return default

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        misses: list[bytes | None] = [None] * len(hashes)
        return self._call("get", lambda: self._client.get(hashes), misses) if hashes else misses

    def get_into(self, hashes: Sequence[BlockHash], buffers: Sequence[Sequence[Part]]) -> list[int | None]:
        misses: list[int | None] = [None] * len(hashes)
        return self._call("get", lambda: self._client.get_into(hashes, buffers), misses) if hashes else misses

    def lease_puts(self, lease_ttl_s: float, lease_id: str = "") -> None:
        """From now on each put also leases its blocks, new or stored before: under ``lease_id`` (a lookup's, which
        the puts extend) or else under the lease the first put takes, until `take_put_lease`."""
        with self._lease_lock:
            self._lease_ttl_s, self._put_lease, self._put_lease_whole = lease_ttl_s, lease_id, True

    def take_put_lease(self) -> tuple[str, bool]:
        """Stops leasing puts; returns their lease ("" if none) and whether it pins every block put since
        `lease_puts` (False where the store took no lease on some: past its caps, or the lease had ended). The
        lease is the caller's to hand on or release; one a put in flight takes from now on is released here."""
        with self._lease_lock:
            lease, whole = self._put_lease, self._put_lease_whole
            self._lease_ttl_s, self._put_lease, self._put_lease_whole = None, "", True
        return lease, whole

    def _leased(self, put: Callable[[float, str | None], PutResult], unleased: Callable[[], int]) -> int:
        with self._lease_lock:
            ttl, asked = self._lease_ttl_s, self._put_lease
        if not ttl:
            return unleased()
        result = put(ttl, asked or None)
        got = result.lease_id or ""
        with self._lease_lock:
            orphan = ""
            if self._lease_ttl_s is None:  # taken meanwhile: nobody hands on a lease this put took
                orphan = got if got != asked else ""
            elif got:
                self._put_lease = got
            else:
                self._put_lease_whole = False
        self.release(orphan)
        return result.num_new

    def put(self, blocks: Iterable[tuple[BlockHash, Payload]], ephemeral: bool = False) -> int:
        items = list(blocks)
        if not items:
            return 0
        return self._call("put", lambda: self._leased(
            lambda ttl, lease: self._client.put_leased(items, ttl, lease_id=lease, ephemeral=ephemeral),
            lambda: self._client.put(items, ephemeral=ephemeral)), 0)

    def tensor_device(self) -> Device | None:
        return self._call("get", self._client.tensor_device, None, TENSOR_ERRORS)

    def get_tensors(self, hashes: Sequence[BlockHash]) -> list[Tensor | None]:
        misses: list[Tensor | None] = [None] * len(hashes)
        return self._call("get", lambda: self._client.get_tensors(hashes), misses, TENSOR_ERRORS) if hashes else misses

    def put_tensors(self, blocks: Iterable[tuple[BlockHash, Sequence[Tensor | bytes]]],
                    ephemeral: bool = False) -> int:
        items = list(blocks)
        if not items:
            return 0
        return self._call("put", lambda: self._leased(
            lambda ttl, lease: self._client.put_tensors_leased(items, ttl, lease_id=lease, ephemeral=ephemeral),
            lambda: self._client.put_tensors(items, ephemeral=ephemeral)), 0, TENSOR_ERRORS)

    def remove(self, hashes: Sequence[BlockHash]) -> int:
        """Drops blocks the engine found bad, so that what it recomputes is stored in their place."""
        return self._call("remove", lambda: self._client.remove(hashes), 0) if hashes else 0

    def release(self, lease_id: str) -> None:
        if self.failed or not lease_id:
            return
        try:
            self._client.release(lease_id)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]  # NOT_FOUND: it expired
                self._fail("release", exc)
        except STORE_ERRORS as exc:
            self._fail("release", exc)
