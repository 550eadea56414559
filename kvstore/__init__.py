"""kvstore: a tiered (device / host / LMDB disk, optionally a shared Redis under them), prefix-keyed store of
opaque KV blocks.

Other packages reach it only through `KVStoreClient`.
"""

from typing import TYPE_CHECKING

from kvstore.client import BlockEvent, KVStoreClient, StoreInfo
from kvstore.types import (
    LookupResult,
    Part,
    Payload,
    PutResult,
    RemoteStats,
    Sink,
    StoreStats,
    Tier,
    TierStats,
)
from protos.block_hash import BlockHash

if TYPE_CHECKING:  # the types of get_tensors and put_tensors, for annotations (importing torch only then)
    from kvstore.device_tier import Device as Device
    from kvstore.device_tier import Tensor as Tensor

__all__ = ["BlockEvent", "BlockHash", "KVStoreClient", "LookupResult", "Part", "Payload", "PutResult", "RemoteStats", "Sink", "StoreInfo",
           "StoreStats", "Tier", "TierStats"]
