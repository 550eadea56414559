"""KV block wire format: a fixed 64-byte header followed by the raw contiguous tensor bytes.

Header (little-endian): magic ``KVB\\x01`` (a KV block; the store's own record header is ``KVSR``),
format version (u16), dtype code (u8), pad (u8), shape ``[layers, 2, num_tokens, kv_heads,
head_dim]`` (5 x u32, token-major: the layout of a KV pool slot, so a block moves in one copy), namespace id (first 16 bytes of the namespace root), xxh3-64 of the payload
(u64; 0 when a block written device to device carries none, and its store's checksum alone covers it),
payload length (u64), zero padding to 64 bytes.
A full block has ``num_tokens == block_size``; a prompt's tail uses the same format with fewer.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from kvserve.engine.hashing import BLOCK_FORMAT_VERSION, Namespace

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
    """A block that must not be used; ``kind`` is one of checksum, dtype, shape, namespace, format, or
    nonfinite (a NaN or an infinity among its values, seen once it is in the pool)."""

    KINDS = frozenset({"checksum", "dtype", "shape", "namespace", "format", "nonfinite"})

    def __init__(self, kind: str, message: str) -> None:
        assert kind in self.KINDS, kind
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def namespace_id(namespace: Namespace) -> bytes:
    return namespace.root()[:NAMESPACE_ID_BYTES]


def encode_parts(kv: torch.Tensor, namespace: Namespace) -> tuple[bytes, memoryview]:
    """One block (or tail) ``kv`` [layers, 2, n, kv_heads, head_dim] as (header, payload bytes): the
    payload is a view of ``kv`` itself when it is contiguous on the CPU (a KV pool slot), so a
    store can copy it once, straight to where it keeps it."""
    encode_header(kv, namespace)  # checks the shape and dtype before any copy
    body = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
    return encode_header(kv, namespace, xxhash.xxh3_64_intdigest(body)), body


def encode_header(kv: torch.Tensor, namespace: Namespace, body_checksum: int = 0) -> bytes:
    """The header of block ``kv`` (on any device). A ``body_checksum`` of 0 says the header carries none: a
    block written device to device is covered by its store's checksum only (taking an xxh3 would mean
    copying it to the host)."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected [layers, 2, n, kv_heads, head_dim], got {list(kv.shape)}")
    if kv.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}")
    header = HEADER.pack(
        BLOCK_MAGIC, BLOCK_FORMAT_VERSION, _DTYPE_CODES[kv.dtype], *kv.shape, namespace_id(namespace),
        body_checksum, kv.numel() * kv.element_size(),
    )  # fmt: skip
    return header.ljust(HEADER_BYTES, b"\x00")


def encode_block(kv: torch.Tensor, namespace: Namespace) -> bytes:
    """Serialise one block (or tail) ``kv`` of shape [layers, 2, n, kv_heads, head_dim]."""
    header, body = encode_parts(kv, namespace)
    return header + body.tobytes()


def verify_block(
    payload: bytes | memoryview,
    namespace: Namespace,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_tokens: int | None = None,
    checked: bool = False,
) -> tuple[memoryview, int]:
    """The checked payload of a block [layers, 2, n, kv_heads, head_dim] and its ``n``, without a copy.

    ``num_tokens`` pins ``n`` (pass ``block_size`` for full blocks); ``None`` accepts any
    ``1 <= n <= namespace.block_size`` (tails). Raises BlockError naming what is wrong; the
    payload is checksummed (where its header carries a checksum) before any byte of it is trusted,
    unless ``checked``: its bytes are already proven (the KV store's client verifies every block it
    hands over against the store's own checksum), and a second pass over them would prove nothing more.
    """
    if len(payload) < HEADER_BYTES:
        raise BlockError("format", f"{len(payload)} bytes is shorter than the {HEADER_BYTES}-byte header")
    body = memoryview(payload)[HEADER_BYTES:]
    checksum, n = check_header(payload, len(body), namespace, num_layers=num_layers, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, dtype=dtype, num_tokens=num_tokens)
    if not checked and checksum and xxhash.xxh3_64_intdigest(body) != checksum:
        raise BlockError("checksum", "payload checksum mismatch (corrupt block)")
    return body, n


def check_header(
    header: bytes | memoryview,
    body_bytes: int,
    namespace: Namespace,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_tokens: int | None = None,
) -> tuple[int, int]:
    """Checks a block's header against the model and a payload of ``body_bytes``: (the payload's
    checksum, its number of tokens ``n``). Raises BlockError (see verify_block)."""
    magic, version, dtype_code, *fields = HEADER.unpack_from(header)
    shape, ns_id, checksum, length = tuple(fields[:5]), fields[5], fields[6], fields[7]
    if magic != BLOCK_MAGIC or version != BLOCK_FORMAT_VERSION:
        raise BlockError("format", f"not a kvserve block of format {BLOCK_FORMAT_VERSION} (magic {magic!r}, "
                                   f"version {version})")
    if length != body_bytes:
        raise BlockError("format", f"payload is {body_bytes} bytes, header says {length}")
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
    if length != n * num_layers * 2 * num_kv_heads * head_dim * dtype.itemsize:
        raise BlockError("format", f"payload of {length} bytes does not match shape {list(shape)}")
    return checksum, n


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
