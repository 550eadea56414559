"""engine.native's kernels for the llama forward's small steps: RMSNorm (after the residual add) and rotary
embeddings with the keys' and values' write into their cache slots, against the torch code they replace."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import native
from kvserve.engine.llama import rms_norm

pytestmark = pytest.mark.skipif(native.rms_norm_kernel() is None, reason="no C kernels here")


@pytest.mark.parametrize("rows", [0, 1, 5, 200])
def test_rms_norm_after_the_residual_add_is_torchs(rows: int) -> None:  # float32
    torch.manual_seed(rows)
    norm = native.rms_norm_kernel()
    assert norm is not None
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    want_residual = residual + x
    want = rms_norm(want_residual, (weight, 1e-5))
    got = norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)  # added in place
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm(residual, None, weight, 1e-5), want, rtol=1e-5, atol=1e-5)


def test_rotary_and_the_cache_write_are_torchs_and_bounds_are_checked() -> None:
    torch.manual_seed(0)
    rope = native.rope_store_kernel()
    assert rope is not None
    heads, kv_heads, d, tokens = 9, 3, 64, 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d)
    cos, sin = torch.randn(100, d), torch.randn(100, d)
    kv = torch.zeros(8, 2, 2, 16, kv_heads, d)
    positions, blocks, offsets = torch.tensor([0, 17, 50, 99, 3]), torch.tensor([7, 0, 3, 3, 5]), torch.tensor([0, 15, 1, 2, 9])
    qk = qkv[:, : heads + kv_heads]
    want = qk * cos[positions][:, None] + qk.roll(d // 2, -1) * sin[positions][:, None]
    values = qkv[:, heads + kv_heads :].clone()
    rope(qkv, cos, sin, positions, kv, 1, blocks, offsets)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(kv[blocks, 1, 0, offsets], qkv[:, heads : heads + kv_heads])
    assert torch.equal(kv[blocks, 1, 1, offsets], values)
    assert kv[:, 0].abs().sum() == 0  # the other layer untouched
    for bad in [(torch.tensor([0, 0, 0, 100, 0]), blocks, offsets), (positions, blocks + 1, offsets),
                (positions, blocks, offsets + 1)]:
        with pytest.raises(ValueError, match="out"):
            rope(qkv, cos, sin, *bad[:1], kv, 1, *bad[1:])


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_in_bfloat16_the_residual_add_and_rms_norm_round_as_torchs(rows: int) -> None:
    """Where bfloat16 ops round (the sum, the normalized row, the weight's product), the kernel rounds: equal to the
    torch code but where the float32 mean of squares, summed in another order, moves a value over a rounding
    boundary (measured: 0.02 % of values, at most two bfloat16 steps apart)."""
    torch.manual_seed(rows)
    norm = native.rms_norm_kernel()
    assert norm is not None
    x, residual = torch.randn(rows, 576).bfloat16(), (torch.randn(rows, 576) * 4).bfloat16()
    weight = torch.randn(576).bfloat16()
    want_residual = residual + x
    want = rms_norm(want_residual, (weight, 1e-5))
    got = norm(x, residual, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(residual, want_residual)  # added in place, rounded as torch rounds
    assert torch.equal(norm(residual, None, weight, 1e-5), got)
    off = got != want
    assert off.float().mean() < 0.001
    step = torch.exp2(torch.floor(torch.log2(want.float()[off].abs())) - 7)  # bfloat16's, at each value
    assert ((got.float()[off] - want.float()[off]).abs() <= 2 * step).all()


def test_in_bfloat16_rotary_rounds_as_torchs() -> None:
    torch.manual_seed(1)
    rope = native.rope_store_kernel()
    assert rope is not None
    heads, kv_heads, d, tokens = 9, 3, 64, 70  # over 64 tokens: rows on both threads
    qkv = torch.randn(tokens, heads + 2 * kv_heads, d).bfloat16()
    cos, sin = torch.randn(100, d).bfloat16(), torch.randn(100, d).bfloat16()
    kv = torch.zeros(80, 2, 2, 16, kv_heads, d, dtype=torch.bfloat16)
    positions, blocks, offsets = torch.randint(0, 100, (tokens,)), torch.randperm(80)[:tokens], torch.randint(0, 16, (tokens,))
    qk = qkv[:, : heads + kv_heads]
    want = qk * cos[positions][:, None] + qk.roll(d // 2, -1) * sin[positions][:, None]  # engine.llama's torch code
    values = qkv[:, heads + kv_heads :].clone()
    rope(qkv, cos, sin, positions, kv, 1, blocks, offsets)
    assert torch.equal(qkv[:, : heads + kv_heads], want)
    assert torch.equal(kv[blocks, 1, 0, offsets], qkv[:, heads : heads + kv_heads])
    assert torch.equal(kv[blocks, 1, 1, offsets], values)
