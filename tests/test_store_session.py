"""kvserve.handoff.session: the store as a best-effort cache for one request."""

from __future__ import annotations

import grpc
import pytest

from kvserve.handoff.session import StoreSession
from tests.stack_fixtures import FakeRpcError, FakeStore

A, B = b"a" * 32, b"b" * 32


def session(store: FakeStore) -> tuple[StoreSession, list[str]]:
    failures: list[str] = []
    return StoreSession(store, failures.append), failures  # type: ignore[arg-type]


def test_calls_pass_through_while_the_store_answers() -> None:
    store = FakeStore()
    s, failures = session(store)
    assert s.put([(A, b"1"), (B, b"2")]) == 2
    assert s.lookup([A, B, b"c" * 32], lease_ttl_s=5.0) == (2, "lease-0")
    assert s.get([B, b"c" * 32]) == [b"2", None]
    s.release("lease-0")
    assert store.leases == {} and failures == [] and not s.failed


def test_empty_calls_do_not_reach_the_store() -> None:
    store = FakeStore()
    s, _ = session(store)
    assert (s.lookup([], 5.0), s.get([]), s.put([])) == ((0, ""), [], 0)
    s.release("")
    assert store.calls == []


def test_the_first_failure_ends_the_store_part_in_the_request() -> None:
    store = FakeStore(down=True)
    s, failures = session(store)
    assert s.lookup([A], 5.0) == (0, "")
    assert s.get([A, B]) == [None, None]
    assert s.put([(A, b"1")]) == 0
    s.release("lease-9")
    assert store.calls == ["lookup"] and failures == ["lookup"] and s.failed


@pytest.mark.parametrize("error", [OSError("shm gone"), ValueError("malformed answer")])
def test_local_errors_are_failures_too(error: Exception) -> None:
    store = FakeStore()

    def get(hashes: object) -> None:
        raise error

    store.get = get  # type: ignore[method-assign,assignment]
    s, failures = session(store)
    assert s.get([A]) == [None] and failures == ["get"]


@pytest.mark.parametrize(("code", "failed"), [(grpc.StatusCode.NOT_FOUND, False), (grpc.StatusCode.UNAVAILABLE, True)])
def test_an_expired_lease_is_not_a_store_failure(code: grpc.StatusCode, failed: bool) -> None:
    store = FakeStore()

    def release(lease_id: str) -> None:
        raise FakeRpcError(code)

    store.release = release  # type: ignore[method-assign]
    s, failures = session(store)
    s.release("lease-0")
    assert s.failed == failed and failures == (["release"] if failed else [])


def test_a_refused_lease_is_a_lookup_without_one_not_a_failure() -> None:
    store = FakeStore()
    s, failures = session(store)
    s.put([(A, b"1"), (B, b"2")])
    lookup = store.lookup

    def capped(hashes: object, lease_ttl_s: float | None = None) -> object:
        if lease_ttl_s:  # this caller pins as much as the store lets one caller pin
            raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)
        return lookup(hashes, lease_ttl_s)  # type: ignore[arg-type]

    store.lookup = capped  # type: ignore[method-assign,assignment]
    assert s.lookup([A, B], lease_ttl_s=5.0) == (2, "")
    assert failures == [] and not s.failed and store.leases == {}


def test_remove_passes_through_and_its_failure_is_a_failure() -> None:
    store = FakeStore()
    s, failures = session(store)
    s.put([(A, b"1"), (B, b"2")])
    assert s.remove([A, b"c" * 32]) == 1 and set(store.blocks) == {B} and s.remove([]) == 0
    store.down = True
    assert s.remove([B]) == 0 and failures == ["remove"] and s.failed


def test_puts_extend_the_lookups_lease_until_it_is_taken() -> None:
    """`lease_puts`: each put leases its blocks under the lookup's lease; a store that leases none (past its caps)
    leaves the lease not whole; a put that lands after `take_put_lease` lets go of the lease it took."""
    store = FakeStore()
    s, failures = session(store)
    s.put([(A, b"1")])
    _, lease = s.lookup([A], lease_ttl_s=5.0)
    s.lease_puts(5.0, lease)
    assert s.put([(A, b"1"), (B, b"2")]) == 1
    assert s.take_put_lease() == (lease, True) and store.leases == {lease: [A, A, B]}
    assert s.take_put_lease() == ("", True)
    s.put([(b"c" * 32, b"3")])  # not leasing now
    assert list(store.leases) == [lease]
    s.release(lease)

    s.lease_puts(5.0)
    put_leased = store.put_leased
    store.put_leased = lambda blocks, ttl, **kw: put_leased(blocks, None, **kw)  # type: ignore[method-assign,assignment]
    s.put([(A, b"1")])  # the store took no lease
    store.put_leased = put_leased  # type: ignore[method-assign]
    s.put([(B, b"2")])
    leased, whole = s.take_put_lease()
    assert leased and not whole and store.leases == {leased: [B]}
    s.release(leased)
    assert store.leases == {} and failures == [] and not s.failed
