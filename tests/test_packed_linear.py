"""engine.packed_linear: an engine's linear layers run on weights oneDNN packed once, with nn.Linear's results
to the last bits, and leave a tied output embedding alone."""

from __future__ import annotations

import pytest
import torch

from engine.packed_linear import PackedLinear, can_pack, pack_linear_layers

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                                          reason="oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT")),
])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_the_linear_layer_does(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for shape in [(1, 1, 512), (1, 37, 512), (4, 512)]:
        x = torch.randn(shape, dtype=dtype)
        with torch.inference_mode():
            want, got = linear(x), packed(x)
        assert got.shape == want.shape and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_every_linear_layer_is_packed_once_but_a_tied_output_embedding() -> None:
    tied = Tiny(tied=True)
    assert pack_linear_layers(tied) == 1
    assert isinstance(tied.proj, PackedLinear) and type(tied.head) is torch.nn.Linear
    assert pack_linear_layers(tied) == 0  # a second engine on the same model finds it packed
    untied = Tiny(tied=False)
    assert pack_linear_layers(untied) == 2


def test_nothing_is_packed_where_onednn_has_no_kernel() -> None:
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)
    assert pack_linear_layers(Tiny(tied=False).to(torch.float16)) == 0
    assert pack_linear_layers(object()) == 0  # a test's stand-in for a model
