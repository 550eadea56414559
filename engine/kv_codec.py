"""KV block wire format: a fixed 64-byte header followed by the raw contiguous tensor bytes.

Header (little-endian): magic ``KVB\\x01`` (a KV block; the store's own record header is ``KVSR``),
format version (u16), dtype code (u8), pad (u8), shape ``[layers, 2, num_tokens, kv_heads,
head_dim]`` (5 x u32, token-major: the layout of a KV pool slot, so a block moves in one copy), namespace id (first 16 bytes of the namespace root), xxh3-64 of the payload
(u64), payload length (u64), zero padding to 64 bytes.
A full block has ``num_tokens == block_size``; a prompt's tail uses the same format with fewer.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from engine.hashing import BLOCK_FORMAT_VERSION, Namespace

BLOCK_MAGIC = b"KVB\x01"
HEADER = struct.Struct("<4sHBx5I16sQQ")
HEADER_BYTES = 64
NAMESPACE_ID_BYTES = 16

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class BlockError(ValueError):
    """A block that must not be used; ``kind`` is one of checksum, dtype, shape, namespace, format."""

    KINDS = frozenset({"checksum", "dtype", "shape", "namespace", "format"})

    def __init__(self, kind: str, message: str) -> None:
        assert kind in self.KINDS, kind
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def namespace_id(namespace: Namespace) -> bytes:
    return namespace.root()[:NAMESPACE_ID_BYTES]


def encode_block(kv: torch.Tensor, namespace: Namespace) -> bytes:
    """Serialise one block (or tail) ``kv`` of shape [layers, 2, n, kv_heads, head_dim]."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected [layers, 2, n, kv_heads, head_dim], got {list(kv.shape)}")
    if kv.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}")
    payload = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    header = HEADER.pack(
        BLOCK_MAGIC,
        BLOCK_FORMAT_VERSION,
        _DTYPE_CODES[kv.dtype],
        *kv.shape,
        namespace_id(namespace),
        xxhash.xxh3_64_intdigest(payload),
        len(payload),
    )
    return header.ljust(HEADER_BYTES, b"\x00") + payload


def verify_block(
    payload: bytes,
    namespace: Namespace,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_tokens: int | None = None,
) -> tuple[memoryview, int]:
    """The checked payload of a block [layers, 2, n, kv_heads, head_dim] and its ``n``, without a copy.

    ``num_tokens`` pins ``n`` (pass ``block_size`` for full blocks); ``None`` accepts any
    ``1 <= n <= namespace.block_size`` (tails). Raises BlockError naming what is wrong; the
    payload is checksummed before any byte of it is trusted.
    """
    if len(payload) < HEADER_BYTES:
        raise BlockError("format", f"{len(payload)} bytes is shorter than the {HEADER_BYTES}-byte header")
    magic, version, dtype_code, *fields = HEADER.unpack_from(payload)
    shape, ns_id, checksum, length = tuple(fields[:5]), fields[5], fields[6], fields[7]
    if magic != BLOCK_MAGIC or version != BLOCK_FORMAT_VERSION:
        raise BlockError("format", f"not a kvserve block of format {BLOCK_FORMAT_VERSION} (magic {magic!r}, "
                                   f"version {version})")
    if length != len(payload) - HEADER_BYTES:
        raise BlockError("format", f"payload is {len(payload) - HEADER_BYTES} bytes, header says {length}")
    if ns_id != namespace_id(namespace):
        raise BlockError("namespace", "block belongs to another namespace (model, dtype, block size or salt)")
    block_dtype = _CODE_DTYPES.get(dtype_code)
    if block_dtype != dtype:
        raise BlockError("dtype", f"block dtype {block_dtype} (code {dtype_code}), expected {dtype}")
    n = shape[2]
    ok_tokens = n == num_tokens if num_tokens is not None else 1 <= n <= namespace.block_size
    if shape[:2] + shape[3:] != (num_layers, 2, num_kv_heads, head_dim) or not ok_tokens:
        expected = [num_layers, 2, num_tokens if num_tokens is not None else "n", num_kv_heads, head_dim]
        raise BlockError("shape", f"block shape {list(shape)}, expected {expected}")
    body = memoryview(payload)[HEADER_BYTES:]
    if length != n * num_layers * 2 * num_kv_heads * head_dim * dtype.itemsize:
        raise BlockError("format", f"payload of {length} bytes does not match shape {list(shape)}")
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise BlockError("checksum", "payload checksum mismatch (corrupt block)")
    return body, n


def decode_block(
    payload: bytes,
    namespace: Namespace,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Verify and deserialise a block into a CPU tensor [layers, 2, n, kv_heads, head_dim] (see verify_block)."""
    body, n = verify_block(payload, namespace, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=dtype, num_tokens=num_tokens)
    # One copy into writable memory; the tensor keeps the bytearray alive.
    return torch.frombuffer(bytearray(body), dtype=dtype).view(num_layers, 2, n, num_kv_heads, head_dim)
