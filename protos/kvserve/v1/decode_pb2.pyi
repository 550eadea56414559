from protos.kvserve.v1 import common_pb2 as _common_pb2
from protos.kvserve.v1 import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "cache", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _common_pb2.Prompt
    sampling: _common_pb2.SamplingParams
    cache: _common_pb2.CacheOptions
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.Prompt, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache: _Optional[_Union[_common_pb2.CacheOptions, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_id", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("finish_reason", "text", "token_ids", "prompt_token_ids", "usage", "timings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    def __init__(self, finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "result")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    token: TokenChunk
    result: GenerateResult
    def __init__(self, token: _Optional[_Union[TokenChunk, _Mapping]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class PrefixHashesResponse(_message.Message):
    __slots__ = ("hashes", "prompt_tokens", "block_size")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    block_size: int
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running", "waiting")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...
