import pytest
import torch

from engine.hashing import Namespace
from engine.kv_codec import HEADER_BYTES, BlockError, decode_block, encode_block

NS = Namespace("ab" * 32, "float32", block_size=4)
SHAPE = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}


def _block(dtype: torch.dtype = torch.float32, n: int = 4) -> torch.Tensor:
    kv = torch.randn(3, 2, 2, n, 8, generator=torch.Generator().manual_seed(n)).to(dtype)  # [L, 2, H, n, D]
    kv.view(-1)[0] = float("nan")
    kv.view(-1)[1] = float("-inf")
    return kv


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    kv = _block(dtype)
    out = decode_block(encode_block(kv, NS), NS, **SHAPE, dtype=dtype, num_tokens=4)
    assert out.shape == kv.shape and out.dtype == dtype
    assert torch.equal(_bits(out), _bits(kv))
    out.add_(1)  # decoded tensors are writable and own their memory


def test_tail_and_non_contiguous_input() -> None:
    kv = _block(n=8)[:, :, :, 5:]  # 3 tokens, a non-contiguous view
    payload = encode_block(kv, NS)
    assert len(payload) == HEADER_BYTES + kv.numel() * 4
    assert torch.equal(_bits(decode_block(payload, NS, **SHAPE, dtype=torch.float32)), _bits(kv))
    assert torch.equal(_bits(decode_block(payload, NS, **SHAPE, dtype=torch.float32, num_tokens=3)), _bits(kv))


def _kind(payload: bytes, ns: Namespace = NS, **overrides: object) -> str:
    kwargs: dict = {**SHAPE, "dtype": torch.float32, "num_tokens": 4, **overrides}
    with pytest.raises(BlockError) as info:
        decode_block(payload, ns, **kwargs)
    return info.value.kind


def test_each_corruption_kind_is_reported() -> None:
    good = encode_block(_block(), NS)
    flipped = bytearray(good)
    flipped[-1] ^= 0x01
    assert _kind(bytes(flipped)) == "checksum"
    assert _kind(good, dtype=torch.bfloat16) == "dtype"
    assert _kind(good, num_layers=4) == "shape"
    assert _kind(good, head_dim=4) == "shape"
    assert _kind(good, num_tokens=3) == "shape"
    assert _kind(good, Namespace("cd" * 32, "float32", 4)) == "namespace"
    assert _kind(good, Namespace("ab" * 32, "float32", 4, cache_salt="other")) == "namespace"
    assert _kind(good[:-4]) == "format"
    assert _kind(good[:10]) == "format"
    assert _kind(b"XXXX" + good[4:]) == "format"


def test_tail_longer_than_a_block_is_a_shape_error() -> None:
    payload = encode_block(_block(n=5), NS)
    assert _kind(payload, num_tokens=None) == "shape"


def test_encode_rejects_wrong_layout() -> None:
    with pytest.raises(ValueError):
        encode_block(torch.zeros(3, 3, 2, 4, 8), NS)
    with pytest.raises(ValueError):
        encode_block(torch.zeros(3, 2, 2, 4, 8, dtype=torch.int32), NS)


def test_decode_leading_stops_at_the_first_miss_or_bad_block() -> None:
    from engine.kv_codec import decode_leading

    blocks = [_block() + i for i in range(4)]
    payloads: list[bytes | None] = [encode_block(kv, NS) for kv in blocks]
    whole = decode_leading(payloads, NS, **SHAPE, dtype=torch.float32)
    assert whole.error is None and len(whole.blocks) == 4
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(whole.blocks, blocks, strict=True))

    missing = decode_leading([*payloads[:2], None, payloads[3]], NS, **SHAPE, dtype=torch.float32)
    assert len(missing.blocks) == 2 and missing.error is None

    bad = bytearray(payloads[1])  # type: ignore[arg-type]
    bad[-1] ^= 0x01
    corrupt = decode_leading([payloads[0], bytes(bad), *payloads[2:]], NS, **SHAPE, dtype=torch.float32)
    assert len(corrupt.blocks) == 1 and corrupt.error is not None and corrupt.error.kind == "checksum"

    tail = encode_block(_block(n=3), NS)  # a tail is not a full block
    assert decode_leading([tail], NS, **SHAPE, dtype=torch.float32).error.kind == "shape"  # type: ignore[union-attr]
