"""kvserve.engine.packed_linear: an engine's linear layers run on weights packed once (for the C kernel, or oneDNN's
layout), with nn.Linear's results to the last bits, siblings that read the same input as one product, and leave a
tied output embedding alone."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from kvserve.engine import native
from kvserve.engine.packed_linear import (
    FEW_ROWS,
    FusedPart,
    PackedEmbedding,
    PackedLinear,
    can_pack,
    has_onednn,
    pack,
    pack_linear_layers,
)

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no kernel, no oneDNN")


@pytest.fixture(params=["native", "onednn"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test below on the C kernel's product and on oneDNN's (KVSERVE_NATIVE_LINEAR=0)."""
    if request.param == "native" and native.linear_kernel() is None:
        pytest.skip("no C kernel here")
    if request.param == "onednn":
        if not has_onednn(torch.device("cpu"), torch.float32):
            pytest.skip("no oneDNN in this torch")
        monkeypatch.setenv("KVSERVE_NATIVE_LINEAR", "0")
    return str(request.param)


@pytest.mark.skipif(native.linear_kernel() is None, reason="no C kernel here")
@pytest.mark.parametrize(("n", "k"), [(32, 16), (33, 7), (100, 576), (576, 1536), (5, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernels_product_is_the_linear_layers_at_every_row_count(n: int, k: int, bias: bool) -> None:
    torch.manual_seed(n * k)
    weight, b = torch.randn(n, k), torch.randn(n) if bias else None
    product = pack(weight, b)
    for x in [*(torch.randn(rows, k) for rows in [0, 1, 2, 7, 8, 9, 16, 17, 40]),
              torch.randn(3, 5, k)[:, ::2]]:  # leading dims, and rows that are not contiguous
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        got, mkl = product(x), torch.nn.functional.linear(x, weight, b)
        assert got.shape == mkl.shape and got.dtype == torch.float32
        # float32 sums in another order, one after the other over k (as oneDNN's packed product sums them): off
        # the exact result by a few times what MKL's blocked sums are
        if x.numel():
            assert (got - exact).abs().max() <= 8 * max((mkl - exact).abs().max(), 1e-6)
    weight.zero_()  # the packed copy is the kernel's own
    assert product(torch.ones(1, k)).abs().sum() > 0
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        product(torch.ones(1, k, dtype=torch.float64))


@pytest.mark.skipif(native.linear_kernel() is None, reason="no C kernel here")
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_a_bfloat16_weights_panels_give_its_products_rounded_once(rows: int) -> None:
    """The panels of a bfloat16 weight, widened to float32 as they are read: the float32 sum of exact products,
    rounded to bfloat16 once, within half a bfloat16 step of the exact result (and a few float32 steps)."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(100, 576).bfloat16(), torch.randn(100).bfloat16()
    panels = native.linear_kernel()(weight, bias)  # type: ignore[misc]
    assert panels.panels.dtype == torch.bfloat16
    ids = torch.tensor([[0, 17], [31, 99]])  # a tied embedding reads the weight's rows back from the panels
    assert torch.equal(panels.rows(ids), weight[ids])
    x = torch.randn(rows, 576).bfloat16()
    got = panels(x)
    assert got.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    product = pack(weight, bias)  # the panels for few rows, oneDNN's copy (where it takes bfloat16) for more
    if rows <= FEW_ROWS or not has_onednn(torch.device("cpu"), torch.bfloat16):
        assert torch.equal(product(x), got)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                                          reason="oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT")),
])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_the_linear_layer_does(dtype: torch.dtype, bias: bool, backend: str) -> None:
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


def test_every_linear_layer_is_packed_once_and_a_tied_table_is_held_once(backend: str) -> None:
    torch.manual_seed(0)
    tied = Tiny(tied=True)
    table, ids = tied.embed.weight.detach().clone(), torch.tensor([[0, 9, 3], [3, 3, 1]])
    x = torch.randn(2, 8)
    want = x @ table.T
    if backend == "native":  # the head packed for the C kernel, the embedding reading its panels
        assert pack_linear_layers(tied) == 2
        assert isinstance(tied.head, PackedLinear) and isinstance(tied.embed, PackedEmbedding)
        assert torch.equal(tied.embed(ids), table[ids])
        with pytest.raises(IndexError):
            tied.embed(torch.tensor([10]))
    else:  # oneDNN's layout is readable only by oneDNN: the tied head stays as it was
        assert pack_linear_layers(tied) == 1
        assert type(tied.head) is torch.nn.Linear and type(tied.embed) is torch.nn.Embedding
    assert isinstance(tied.proj, PackedLinear)
    torch.testing.assert_close(tied.head(x), want, rtol=1e-5, atol=1e-5)
    assert pack_linear_layers(tied) == 0  # a second engine on the same model finds it packed
    untied = Tiny(tied=False)
    assert pack_linear_layers(untied) == 2 and type(untied.embed) is torch.nn.Embedding


def test_nothing_is_packed_where_no_kernel_computes_the_dtype() -> None:
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)
    assert pack_linear_layers(Tiny(tied=False).to(torch.float16)) == 0
    assert pack_linear_layers(object()) == 0  # a test's stand-in for a model


class Attention(torch.nn.Module):
    """q, k and v projections as Llama names them, and an o that is no sibling."""

    def __init__(self, bias: bool = False, v_in: int = 64) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 64, bias=bias)
        self.k_proj = torch.nn.Linear(64, 32, bias=bias)
        self.v_proj = torch.nn.Linear(v_in, 32, bias=bias)
        self.o_proj = torch.nn.Linear(64, 64, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q + torch.cat([k, v], dim=-1))

    def get_input_embeddings(self) -> None:
        return None

    def get_output_embeddings(self) -> None:
        return None


@pytest.mark.parametrize("bias", [True, False])
def test_siblings_that_read_one_input_compute_what_each_linear_layer_does(bias: bool, backend: str) -> None:
    torch.manual_seed(0)
    model = Attention(bias)
    linears = {name: getattr(model, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert pack_linear_layers(model) == 4
    assert all(isinstance(getattr(model, name), FusedPart) for name in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(model.o_proj, PackedLinear)
    assert [tuple(getattr(model, n).weight.shape) for n in linears] == [(64, 64), (32, 64), (32, 64), (64, 64)]
    x, y = torch.randn(1, 5, 64), torch.randn(1, 3, 64)
    with torch.inference_mode():
        # in any order, and an input of its own in between: each gets its own columns of its own input's product
        for name, inp in [("v_proj", x), ("q_proj", x), ("k_proj", y), ("k_proj", x), ("q_proj", y), ("v_proj", y)]:
            got, want = getattr(model, name)(inp), linears[name](inp)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), Attention.forward(_unpacked(linears), x), rtol=1e-5, atol=1e-5)
        z = torch.randn(1, 2, 64)
        held = weakref.ref(z)
        model(z)
    del z
    assert held() is None  # no input held past the parent's call


def _unpacked(linears: dict[str, torch.nn.Linear]) -> Attention:
    model = Attention()
    for name, linear in linears.items():
        setattr(model, name, linear)
    return model


def test_each_thread_takes_its_own_inputs_product() -> None:
    torch.manual_seed(0)
    model = Attention()
    k_proj = model.k_proj
    pack_linear_layers(model)
    inputs = [torch.randn(1, 4, 64) for _ in range(2)]
    wrong: list[int] = []
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        with torch.inference_mode():
            for _ in range(200):
                model.q_proj(inputs[i])  # computes the product for this thread's input
                barrier.wait()  # the other thread's q_proj has run too
                if not torch.allclose(model.k_proj(inputs[i]), k_proj(inputs[i]), rtol=1e-5, atol=1e-5):
                    wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_siblings_that_disagree_are_packed_apart() -> None:
    model = Attention(v_in=48)  # v reads another width: not the same input
    assert pack_linear_layers(model) == 4
    assert all(isinstance(getattr(model, n), PackedLinear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert pack_linear_layers(model) == 0


def test_panels_lie_aligned_and_apart_in_memory_that_outlives_its_allocator() -> None:
    """PanelLinear's memory (native._PanelMemory): each tensor 64-byte aligned, none overlapping, one larger than a
    mapping in a mapping of its own, and each usable after the allocator and its mappings are let go."""
    memory = native._PanelMemory()
    shapes = [(3, 5, 32), (1, 7, 32), (2, 1, 32), (native.PANEL_MAPPING_BYTES // 4 // 32 + 1, 1, 32), (1, 1, 32)]
    tensors = [memory.empty(shape) for shape in shapes]
    del memory
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(tensors):
        t.fill_(i)
    assert [int(t.sum()) for t in tensors] == [i * t.numel() for i, t in enumerate(tensors)]
