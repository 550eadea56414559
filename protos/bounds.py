"""What a router believes of a decode replica, and past which bounds a replica is lying (docs/DESIGN.md,
"Router"): a contract between the services, so it lives beside their protos (decode checks the store's
events it relays by the same bounds). Every claim a replica sends (its Events, its Load, a prompt's PrefixHashes) is checked here
before anything it names is kept; a claim out of bounds raises `Lie`, and the router then drops all that
replica told it (router.router.Replica.distrust).

A decode replica sends its events in pieces of at most MAX_EVENT_HASHES (decode_service/replica.py),
so an honest stream never comes near the bounds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from protos.block_hash import HASH_BYTES, BlockHash
from protos.kvserve.v1 import decode_pb2, kvstore_pb2

# Hashes in one Event: 4096 blocks are a 64 Ki-token prompt at 16 tokens a block. A replica cuts its pool
# snapshot and its store's batches (up to 10,000 hashes) into pieces of this many.
MAX_EVENT_HASHES = 4096
# Hashes of a prompt a router weighs: a longer prompt is placed by its first 64 Ki tokens.
MAX_PROMPT_HASHES = MAX_EVENT_HASHES
# Sequences a replica may say it runs and has waiting: each holds one of its server's workers (64 by
# default), so 65,536 is no deployment's; a replica that says more is not believed.
MAX_LOAD = 1 << 16

KINDS = frozenset({kvstore_pb2.Event.KIND_STORED, kvstore_pb2.Event.KIND_REMOVED})
STORE_TIERS = frozenset({kvstore_pb2.TIER_UNSPECIFIED, kvstore_pb2.TIER_DEVICE, kvstore_pb2.TIER_HOST,
                         kvstore_pb2.TIER_DISK})
REPLICA_TIERS = STORE_TIERS | {kvstore_pb2.TIER_ENGINE}  # a replica adds its own KV pool to its store's

REASONS = ("hash", "count", "kind", "tier", "load")  # why a claim was not believed: a metric's label


class Lie(Exception):
    """A claim out of bounds; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


def check_hashes(hashes: Sequence[bytes], what: str) -> None:
    for h in hashes:
        if len(h) != HASH_BYTES:
            raise Lie("hash", f"{what} names a block hash of {len(h)} bytes, not {HASH_BYTES}")


def check_event(event: kvstore_pb2.Event, tiers: frozenset[int] = REPLICA_TIERS,
                most: int | None = MAX_EVENT_HASHES) -> None:
    """An Event's kind, tier (one of `tiers`), number of hashes (at most `most`; None: any) and each hash."""
    if event.kind not in KINDS:
        raise Lie("kind", f"an event of kind {event.kind}, neither stored nor removed")
    if event.tier not in tiers:
        raise Lie("tier", f"an event of tier {event.tier}, not one of {sorted(tiers)}")
    if most is not None and len(event.hashes) > most:
        raise Lie("count", f"an event names {len(event.hashes)} block hashes, more than {most}")
    check_hashes(event.hashes, "an event")


def check_load(reply: decode_pb2.LoadResponse) -> int:
    """The sequences a replica runs and has waiting."""
    load = int(reply.running) + int(reply.waiting)
    if load > MAX_LOAD:
        raise Lie("load", f"a load of {reply.running} running and {reply.waiting} waiting, more than {MAX_LOAD}")
    return load


def prompt_hashes(reply: decode_pb2.PrefixHashesResponse) -> list[BlockHash]:
    """A prompt's block hashes, at most MAX_PROMPT_HASHES of them: no more than its full blocks, each a hash."""
    full = reply.prompt_tokens // reply.block_size if reply.block_size else 0
    if len(reply.hashes) > full:
        raise Lie("count", f"{len(reply.hashes)} block hashes for {reply.prompt_tokens} prompt tokens at "
                           f"{reply.block_size} a block")
    hashes = list(reply.hashes[:MAX_PROMPT_HASHES])
    check_hashes(hashes, "a prompt")
    return [BlockHash(h) for h in hashes]


def pieces(hashes: Sequence[bytes], most: int = MAX_EVENT_HASHES) -> Iterator[Sequence[bytes]]:
    """`hashes` in runs of at most `most`, in order: what one Event may carry."""
    for start in range(0, len(hashes), most):
        yield hashes[start : start + most]
