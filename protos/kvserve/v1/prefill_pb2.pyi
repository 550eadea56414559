from protos.kvserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "cache", "num_stored_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _common_pb2.Prompt
    sampling: _common_pb2.SamplingParams
    cache: _common_pb2.CacheOptions
    num_stored_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache: _Optional[_Union[_common_pb2.CacheOptions, _Mapping]] = ..., num_stored_blocks: _Optional[int] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("lookup_s", "fetch_s", "compute_s", "put_s", "total_s")
    LOOKUP_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PUT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    lookup_s: float
    fetch_s: float
    compute_s: float
    put_s: float
    total_s: float
    def __init__(self, lookup_s: _Optional[float] = ..., fetch_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., put_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "block_size", "block_hashes", "tail_key", "num_cached_tokens", "num_computed_tokens", "first_token_id", "timings", "lease_id", "model_fingerprint", "kv_pending")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_PENDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tail_key: bytes
    num_cached_tokens: int
    num_computed_tokens: int
    first_token_id: int
    timings: PrefillTimings
    lease_id: str
    model_fingerprint: str
    kv_pending: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., tail_key: _Optional[bytes] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., lease_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_pending: _Optional[bool] = ...) -> None: ...
