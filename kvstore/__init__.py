"""kvstore: a tiered (device / host / LMDB disk, optionally a shared Redis under them), prefix-keyed store of
opaque KV blocks.

Other packages reach it only through `KVStoreClient`.
"""

from kvstore.client import BlockEvent, KVStoreClient, StoreInfo
from kvstore.types import LookupResult, Payload, RemoteStats, StoreStats, Tier, TierStats
from protos.block_hash import BlockHash

__all__ = ["BlockEvent", "BlockHash", "KVStoreClient", "LookupResult", "Payload", "RemoteStats", "StoreInfo", "StoreStats", "Tier", "TierStats"]
