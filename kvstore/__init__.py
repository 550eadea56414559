"""kvstore: a tiered (device / host / LMDB disk), prefix-keyed store of opaque KV blocks.

Other packages reach it only through `KVStoreClient`.
"""

from kvstore.client import BlockEvent, KVStoreClient, StoreInfo
from kvstore.types import BlockHash, LookupResult, StoreStats, Tier, TierStats

__all__ = ["BlockEvent", "BlockHash", "KVStoreClient", "LookupResult", "StoreInfo", "StoreStats", "Tier", "TierStats"]
