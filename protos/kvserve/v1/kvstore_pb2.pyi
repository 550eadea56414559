from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_ENGINE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_ENGINE: Tier

class LookupRequest(_message.Message):
    __slots__ = ("hashes", "lease_ttl_s")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_s: float
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hits", "tiers", "lease_id", "lease_ttl_s")
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lease_id: str
    lease_ttl_s: float
    def __init__(self, num_hits: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("hash", "total_size", "checksum", "offset", "data", "shm_offset")
    HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    total_size: int
    checksum: int
    offset: int
    data: bytes
    shm_offset: int
    def __init__(self, hash: _Optional[bytes] = ..., total_size: _Optional[int] = ..., checksum: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., shm_offset: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("chunk", "ephemeral", "staged", "reservation_id", "lease_ttl_s", "lease_id", "stored")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    chunk: BlockChunk
    ephemeral: bool
    staged: _containers.RepeatedCompositeFieldContainer[BlockChunk]
    reservation_id: str
    lease_ttl_s: float
    lease_id: str
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, chunk: _Optional[_Union[BlockChunk, _Mapping]] = ..., ephemeral: _Optional[bool] = ..., staged: _Optional[_Iterable[_Union[BlockChunk, _Mapping]]] = ..., reservation_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., lease_id: _Optional[str] = ..., stored: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_new", "num_existing", "lease_id", "lease_ttl_s")
    NUM_NEW_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    num_new: int
    num_existing: int
    lease_id: str
    lease_ttl_s: float
    def __init__(self, num_new: _Optional[int] = ..., num_existing: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("hashes", "via_shm")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    VIA_SHM_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    via_shm: bool
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., via_shm: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("chunk", "found", "tier", "slots")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    chunk: BlockChunk
    found: bool
    tier: Tier
    slots: _containers.RepeatedCompositeFieldContainer[BlockChunk]
    def __init__(self, chunk: _Optional[_Union[BlockChunk, _Mapping]] = ..., found: _Optional[bool] = ..., tier: _Optional[_Union[Tier, str]] = ..., slots: _Optional[_Iterable[_Union[BlockChunk, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "blocks", "bytes", "capacity_bytes", "hits", "misses", "evictions", "demotions", "promotions", "unavailable")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    unavailable: bool
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., unavailable: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "leases", "pinned_blocks", "checksum_failures", "disk_write_failures", "removed_blocks", "remote", "mac_failures")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    MAC_FAILURES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    leases: int
    pinned_blocks: int
    checksum_failures: int
    disk_write_failures: int
    removed_blocks: int
    remote: RemoteStats
    mac_failures: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., leases: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., disk_write_failures: _Optional[int] = ..., removed_blocks: _Optional[int] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ..., mac_failures: _Optional[int] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("url", "breaker", "hits", "misses", "read_errors", "write_errors", "checksum_failures", "read_bytes", "written_blocks", "written_bytes", "dropped_writes", "queued_blocks", "queued_bytes", "read_calls", "read_seconds", "write_calls", "write_seconds", "mac_failures")
    class Breaker(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BREAKER_UNSPECIFIED: _ClassVar[RemoteStats.Breaker]
        BREAKER_CLOSED: _ClassVar[RemoteStats.Breaker]
        BREAKER_OPEN: _ClassVar[RemoteStats.Breaker]
        BREAKER_HALF_OPEN: _ClassVar[RemoteStats.Breaker]
    BREAKER_UNSPECIFIED: RemoteStats.Breaker
    BREAKER_CLOSED: RemoteStats.Breaker
    BREAKER_OPEN: RemoteStats.Breaker
    BREAKER_HALF_OPEN: RemoteStats.Breaker
    URL_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    READ_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_CALLS_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_CALLS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAC_FAILURES_FIELD_NUMBER: _ClassVar[int]
    url: str
    breaker: RemoteStats.Breaker
    hits: int
    misses: int
    read_errors: int
    write_errors: int
    checksum_failures: int
    read_bytes: int
    written_blocks: int
    written_bytes: int
    dropped_writes: int
    queued_blocks: int
    queued_bytes: int
    read_calls: int
    read_seconds: float
    write_calls: int
    write_seconds: float
    mac_failures: int
    def __init__(self, url: _Optional[str] = ..., breaker: _Optional[_Union[RemoteStats.Breaker, str]] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., read_errors: _Optional[int] = ..., write_errors: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., read_bytes: _Optional[int] = ..., written_blocks: _Optional[int] = ..., written_bytes: _Optional[int] = ..., dropped_writes: _Optional[int] = ..., queued_blocks: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., read_calls: _Optional[int] = ..., read_seconds: _Optional[float] = ..., write_calls: _Optional[int] = ..., write_seconds: _Optional[float] = ..., mac_failures: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "hashes", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        KIND_STORED: _ClassVar[Event.Kind]
        KIND_REMOVED: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    KIND_STORED: Event.Kind
    KIND_REMOVED: Event.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: Event.Kind
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    def __init__(self, kind: _Optional[_Union[Event.Kind, str]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("host_id", "arena_socket", "max_message_bytes")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    arena_socket: str
    max_message_bytes: int
    def __init__(self, host_id: _Optional[str] = ..., arena_socket: _Optional[str] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("sizes", "hashes")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "offsets", "stored")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, reservation_id: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., stored: _Optional[_Iterable[bool]] = ...) -> None: ...
