"""The key of a KV block, as every part names it: on the wire (`bytes hash` fields of kvserve.v1),
in the engine that computes it, in the store that keys its tiers by it, and in the services."""

from __future__ import annotations

from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""A 32-byte sha256 digest naming a full block and every token before it (docs/DESIGN.md, "Prefix
hashing"), or a request-scoped key of the same size for a block no other request may name."""

HASH_BYTES = 32
