import pytest
import torch
import xxhash

from kvserve.engine.hashing import BLOCK_FORMAT_VERSION, Namespace
from kvserve.handoff.codec import (
    BLOCK_MAGIC,
    HEADER,
    HEADER_BYTES,
    BlockError,
    decode_block,
    encode_block,
    namespace_id,
    verify_block,
)

NS = Namespace("ab" * 32, "float32", block_size=4)
SHAPE = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}


def _block(dtype: torch.dtype = torch.float32, n: int = 4) -> torch.Tensor:
    kv = torch.randn(3, 2, n, 2, 8, generator=torch.Generator().manual_seed(n)).to(dtype)  # [L, 2, n, H, D]
    kv.view(-1)[0] = float("nan")
    kv.view(-1)[1] = float("-inf")
    return kv


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    kv = _block(dtype)
    out = decode_block(encode_block(kv, NS), NS, **SHAPE, dtype=dtype, num_tokens=4)
    assert out.shape == kv.shape == (3, 2, 4, 2, 8) and out.dtype == dtype
    assert torch.equal(_bits(out), _bits(kv))
    out.add_(1)  # decoded tensors are writable and own their memory


def test_payload_is_token_major() -> None:
    kv = torch.arange(3 * 2 * 4 * 2 * 8, dtype=torch.float32).view(3, 2, 4, 2, 8)  # [L, 2, n, H, D]
    payload = encode_block(kv, NS)
    body = torch.frombuffer(bytearray(payload[HEADER_BYTES:]), dtype=torch.float32)
    assert torch.equal(body, torch.arange(kv.numel(), dtype=torch.float32))
    magic, version, _, *shape = HEADER.unpack_from(payload)[:8]
    assert (magic, version, shape) == (BLOCK_MAGIC, BLOCK_FORMAT_VERSION, [3, 2, 4, 2, 8])
    # token 1 of layer 0's keys is the 16 values after token 0: all heads of a token are together
    assert body[16:32].tolist() == kv[0, 0, 1].reshape(-1).tolist()


def test_tail_and_non_contiguous_input() -> None:
    kv = _block(n=8)[:, :, 5:]  # 3 tokens, a non-contiguous view
    assert not kv.is_contiguous()
    payload = encode_block(kv, NS)
    assert len(payload) == HEADER_BYTES + kv.numel() * 4
    assert torch.equal(_bits(decode_block(payload, NS, **SHAPE, dtype=torch.float32)), _bits(kv))
    assert torch.equal(_bits(decode_block(payload, NS, **SHAPE, dtype=torch.float32, num_tokens=3)), _bits(kv))


def test_verify_block_returns_the_payload_without_a_copy() -> None:
    kv = _block()
    payload = encode_block(kv, NS)
    body, n = verify_block(payload, NS, **SHAPE, dtype=torch.float32, num_tokens=4)
    assert n == 4
    assert isinstance(body, memoryview) and body.obj is payload  # a view of the very same bytes
    assert body.nbytes == len(payload) - HEADER_BYTES and bytes(body) == payload[HEADER_BYTES:]
    body, n = verify_block(encode_block(_block(n=2), NS), NS, **SHAPE, dtype=torch.float32)
    assert n == 2 and body.nbytes == 3 * 2 * 2 * 2 * 8 * 4


def _kind(payload: bytes, ns: Namespace = NS, match: str | None = None, **overrides: object) -> str:
    kwargs: dict = {**SHAPE, "dtype": torch.float32, "num_tokens": 4, **overrides}
    with pytest.raises(BlockError, match=match) as info:
        verify_block(payload, ns, **kwargs)
    assert str(info.value).startswith(f"{info.value.kind}: ")
    with pytest.raises(BlockError):
        decode_block(payload, ns, **kwargs)
    return info.value.kind


def test_each_corruption_kind_is_reported() -> None:
    good = encode_block(_block(), NS)
    flipped = bytearray(good)
    flipped[-1] ^= 0x01
    assert _kind(bytes(flipped)) == "checksum"
    assert _kind(good, dtype=torch.bfloat16) == "dtype"
    assert _kind(good, num_layers=4) == "shape"
    assert _kind(good, num_kv_heads=1) == "shape"
    assert _kind(good, head_dim=4) == "shape"
    assert _kind(good, num_tokens=3) == "shape"
    assert _kind(good, Namespace("cd" * 32, "float32", 4)) == "namespace"
    assert _kind(good, Namespace("ab" * 32, "float32", 4, cache_salt="other")) == "namespace"
    assert _kind(good, Namespace("ab" * 32, "float32", 4, format_version=1)) == "namespace"
    assert _kind(good[:-4]) == "format"  # shorter than its header says
    assert _kind(good[:10]) == "format"  # shorter than a header
    assert _kind(b"XXXX" + good[4:]) == "format"  # not a block


def test_header_that_disagrees_with_its_payload_is_a_format_error() -> None:
    kv = _block()
    body = kv.contiguous().view(torch.uint8).numpy().tobytes()
    # a header claiming 2 tokens over a payload of 4, its length and checksum consistent
    header = HEADER.pack(BLOCK_MAGIC, BLOCK_FORMAT_VERSION, 1, 3, 2, 2, 2, 8, namespace_id(NS),
                         xxhash.xxh3_64_intdigest(body), len(body))
    assert _kind(header.ljust(HEADER_BYTES, b"\x00") + body, match="does not match shape", num_tokens=2) == "format"


def test_a_block_of_format_version_1_is_refused() -> None:
    # version 1 was head-major [layers, 2, kv_heads, n, head_dim]: the same bytes mean other values
    kv = _block().transpose(2, 3).contiguous()  # [L, 2, H, n, D]
    body = kv.view(torch.uint8).numpy().tobytes()
    header = HEADER.pack(BLOCK_MAGIC, 1, 1, *kv.shape, namespace_id(NS), xxhash.xxh3_64_intdigest(body), len(body))
    old = header.ljust(HEADER_BYTES, b"\x00") + body
    assert _kind(old, match="version 1") == "format"
    assert _kind(old, num_tokens=None) == "format"
    current = HEADER.pack(BLOCK_MAGIC, BLOCK_FORMAT_VERSION, 1, *kv.shape, namespace_id(NS),
                          xxhash.xxh3_64_intdigest(body), len(body))
    assert BLOCK_FORMAT_VERSION == 2
    assert verify_block(current.ljust(HEADER_BYTES, b"\x00") + body, NS, num_layers=3, num_kv_heads=4,
                        head_dim=8, dtype=torch.float32, num_tokens=2)[1] == 2  # only the version differed


def test_tail_longer_than_a_block_is_a_shape_error() -> None:
    payload = encode_block(_block(n=5), NS)
    assert _kind(payload, num_tokens=None) == "shape"


def test_encode_rejects_wrong_layout() -> None:
    with pytest.raises(ValueError):
        encode_block(torch.zeros(3, 3, 4, 2, 8), NS)
    with pytest.raises(ValueError):
        encode_block(torch.zeros(3, 2, 4, 2), NS)
    with pytest.raises(ValueError):
        encode_block(torch.zeros(3, 2, 4, 2, 8, dtype=torch.int32), NS)
